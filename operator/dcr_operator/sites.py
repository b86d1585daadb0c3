"""Where a refit's encoder and snapshot Jobs run: the fleet's namespace, or a training cluster.

An encoder profile with ``cluster`` sends its Jobs (and the receiver profile's ConfigMap
they mount) to a namespace of another cluster, reached with a kubeconfig from a Secret the
fleet's owner labelled ``dcr.dev/encoder-cluster=true``. The kubeconfig is the fleet
author's input, so :func:`kubeconfig_configuration` takes only what cannot reach into the
operator's own pod: an https server and an inline token or client certificate; an exec
plugin, an auth provider or a file path would run a command or read a file as the operator.
Its YAML is read with a loader that refuses anchors and aliases (a few hundred bytes of
nested aliases expand to billions of nodes when rendered), within :data:`KUBECONFIG_MAX_BYTES`,
and every value taken must be a string. docs/two-clusters.md, "Two clusters"; docs/security.md.
"""

from __future__ import annotations

import logging
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from kubernetes.client import Configuration
from kubernetes.config import ConfigException
from kubernetes.config.kube_config import load_kube_config_from_dict

from dcr_operator.api.common import API_VERSION, GROUP
from dcr_operator.api.rolloutfleet import EncoderProfile, KubeconfigSecretRef
from dcr_operator.errors import InvalidResource
from dcr_operator.fleet import ENCODER_CLUSTER, read_secret
from dcr_operator.kube import KubeClient

# The only keys a kubeconfig's user and cluster may have: inline credentials, no paths.
USER_KEYS = frozenset({"token", "client-certificate-data", "client-key-data"})
CLUSTER_KEYS = frozenset({"server", "certificate-authority-data", "tls-server-name"})
UID_LABEL = f"{GROUP}/refit-uid"
# Bytes of a kubeconfig: inline CA, client certificate and key are a few KiB together.
KUBECONFIG_MAX_BYTES = 64 << 10

log = logging.getLogger(__name__)


class _Aliased(InvalidResource):
    """The document has an anchor or an alias (raised from inside the loader, and said
    again with the Secret's name by :func:`_load`)."""


class _NoAliases(yaml.SafeLoader):
    """The safe loader without anchors and aliases: every node is written out once, so
    what the document holds costs what its bytes cost."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Aliased
        return super().compose_node(parent, index)


def _load(text: str, where: str) -> Any:
    """``text`` as plain YAML; InvalidResource if it is too large, not YAML, or has an
    anchor or alias (never quoting it)."""
    size = len(text.encode())
    if size > KUBECONFIG_MAX_BYTES:
        raise InvalidResource(f"{where} holds {size} bytes, more than the "
                              f"{KUBECONFIG_MAX_BYTES} a kubeconfig may have.")
    try:
        return yaml.load(text, Loader=_NoAliases)  # a SafeLoader: no Python objects
    except _Aliased:
        raise InvalidResource(f"{where} uses YAML anchors or aliases (&name, *name): the "
                              "operator takes only a plain kubeconfig, every value written "
                              "out.") from None
    except yaml.YAMLError:
        raise InvalidResource(f"{where} is not YAML.") from None


def _strings(values: dict[str, Any], what: str, where: str) -> dict[str, Any]:
    """``values`` if each is a string; else InvalidResource naming the key."""
    for key, value in values.items():
        if not isinstance(value, str):
            raise InvalidResource(f"{where}: the {what}'s {key!r} is not a string.")
    return values


@dataclass(frozen=True)
class Site:
    """A namespace where Jobs run; ``cluster`` names the kubeconfig Secret of a cluster
    other than the operator's (None: the fleet's own namespace)."""

    kube: KubeClient
    namespace: str
    cluster: str | None = None

    @property
    def remote(self) -> bool:
        return self.cluster is not None

    def owner_references(self, refit: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The refit as owner, so its deletion collects the Jobs; none in another cluster
        (the uid means nothing there: its garbage collector would delete them at once)."""
        return [] if self.remote else [owner_reference(refit)]

    def labels(self, refit: Mapping[str, Any]) -> dict[str, str]:
        """What marks an object as the refit's where no ownerReference can."""
        return {UID_LABEL: refit["metadata"]["uid"]}

    def __str__(self) -> str:
        where = f" of the cluster in Secret {self.cluster}" if self.remote else ""
        return f"namespace {self.namespace}{where}"


def owner_reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {"apiVersion": obj.get("apiVersion", API_VERSION),
            "kind": obj.get("kind", "WeightRefit"), "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _one(items: Any, name: Any, kind: str, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not isinstance(items, list | None):
        raise InvalidResource(f"{where}: the current context's {kind} is not named by a "
                              "string in a list.")
    found = [i for i in items or [] if isinstance(i, dict) and i.get("name") == name]
    if len(found) != 1 or not isinstance(found[0].get(kind), dict):
        raise InvalidResource(f"{where}: the current context's {kind} {name!r} is not "
                              "defined once.")
    return dict(found[0][kind])


def kubeconfig_configuration(text: str, where: str) -> Configuration:
    """The library configuration for the current context of kubeconfig ``text``.

    InvalidResource naming the offending key (never a value) unless its user has only
    an inline token or client certificate and its cluster an https server with inline
    CA data: nothing that runs a command or reads a file on the operator's pod; and
    unless it is plain YAML (no anchor or alias) of at most :data:`KUBECONFIG_MAX_BYTES`
    whose taken values are strings.
    """
    doc = _load(text, where)
    if not isinstance(doc, dict) or not isinstance(doc.get("current-context"), str):
        raise InvalidResource(f"{where} is not a kubeconfig with a current-context.")
    current = doc["current-context"]
    context = _one(doc.get("contexts"), current, "context", where)
    cluster = _one(doc.get("clusters"), context.get("cluster"), "cluster", where)
    user = _one(doc.get("users"), context.get("user"), "user", where)
    for keys, allowed, what in ((user, USER_KEYS, "user"), (cluster, CLUSTER_KEYS, "cluster")):
        extra = sorted(set(keys) - allowed, key=str)
        if extra:
            raise InvalidResource(
                f"{where}: the {what}'s {', '.join(map(repr, extra))} is not accepted: the "
                f"operator takes only {', '.join(sorted(allowed))} (nothing that runs a "
                "command or reads a file on its pod).")
    for values, what in ((context, "context"), (cluster, "cluster"), (user, "user")):
        _strings(values, what, where)
    server = urllib.parse.urlsplit(cluster.get("server", ""))
    if server.scheme != "https" or not server.hostname:
        raise InvalidResource(f"{where}: the cluster's server must be an https:// URL.")
    if "token" not in user and not {"client-certificate-data", "client-key-data"} <= set(user):
        raise InvalidResource(f"{where}: the user has neither a token nor a client "
                              "certificate and key.")
    checked = {"current-context": current,
               "contexts": [{"name": current, "context": {
                   "cluster": "training", "user": "operator",
                   **({"namespace": context["namespace"]} if "namespace" in context else {})}}],
               "clusters": [{"name": "training", "cluster": cluster}],
               "users": [{"name": "operator", "user": user}]}
    config = Configuration()
    try:
        load_kube_config_from_dict(checked, client_configuration=config, persist_config=False,
                                   temp_file_path=tempfile.gettempdir())  # type: ignore[no-untyped-call]
    except (ConfigException, ValueError, TypeError) as e:
        raise InvalidResource(f"{where} could not be loaded ({type(e).__name__}).") from None
    return config


def _cluster_configuration(kube: KubeClient, namespace: str, ref: KubeconfigSecretRef
                           ) -> Configuration:
    """The kubeconfig in Secret ``ref`` of ``namespace``, checked; InvalidResource if the
    Secret did not opt in or holds no acceptable kubeconfig."""
    data = read_secret(kube, namespace, ref.name, ENCODER_CLUSTER)
    where = f"Secret {namespace}/{ref.name} key {ref.key!r}"
    if ref.key not in data:
        raise InvalidResource(f"{where} does not exist ({ENCODER_CLUSTER.field}).")
    return kubeconfig_configuration(data[ref.key], where)


def encoder_site(kube: KubeClient, namespace: str, profile: EncoderProfile) -> Site:
    """Where ``profile``'s Jobs run; InvalidResource if its cluster's Secret did not opt
    in to that use or holds no acceptable kubeconfig.

    The Secret is read now, and again each time the training cluster refuses the
    credentials (401: a token rotated and the old one revoked), so a Secret updated
    mid-refit is used from the next call on (:class:`~dcr_operator.kube.KubeClient`).
    """
    if profile.cluster is None:
        return Site(kube, namespace)
    ref = profile.cluster.kubeconfig_secret_ref
    first = [_cluster_configuration(kube, namespace, ref)]

    def configure() -> Configuration:
        if first:
            return first.pop()
        log.info("the cluster in Secret %s/%s refused its credentials: reading the Secret "
                 "again", namespace, ref.name)
        return _cluster_configuration(kube, namespace, ref)

    return Site(KubeClient(configure), profile.cluster.namespace, cluster=ref.name)
