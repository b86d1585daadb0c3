"""What the operator takes from a kubeconfig a fleet names for its encoder cluster.

The Secret is the fleet author's input and the operator loads it in its own pod, so
anything in it that runs a command (exec plugins, auth providers) or reads a file
(token, certificate and key paths) would act as the operator: each is refused, naming
the key and never a value. Without these checks the library would run the command.
"""

from __future__ import annotations

import base64
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.errors import InvalidResource
from dcr_operator.sites import kubeconfig_configuration

TOKEN = "training-cluster-token-0123456789"
GOOD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Config", "current-context": "train",
    "contexts": [{"name": "train", "context": {"cluster": "c", "user": "u",
                                               "namespace": "encoders"}},
                 {"name": "other", "context": {"cluster": "c2", "user": "u2"}}],
    "clusters": [{"name": "c", "cluster": {
        "server": "https://10.1.2.3:6443",
        "certificate-authority-data": base64.b64encode(b"not a real CA").decode()}},
        {"name": "c2", "cluster": {"server": "https://elsewhere"}}],
    "users": [{"name": "u", "user": {"token": TOKEN}},
              {"name": "u2", "user": {"exec": {"command": "ignored-not-current"}}}]}


def config(change: dict[str, Any] | None = None, *, user: dict[str, Any] | None = None,
           cluster: dict[str, Any] | None = None) -> str:
    doc = copy.deepcopy(GOOD)
    if user is not None:
        doc["users"][0]["user"] = user
    if cluster is not None:
        doc["clusters"][0]["cluster"] = {**doc["clusters"][0]["cluster"], **cluster}
    doc.update(change or {})
    return yaml.safe_dump(doc)


def test_the_current_context_with_an_inline_token_is_loaded() -> None:
    got = kubeconfig_configuration(config(), "Secret ns/train key 'kubeconfig'")
    assert got.host == "https://10.1.2.3:6443"
    assert got.api_key["BearerToken"] == f"Bearer {TOKEN}"
    assert Path(got.ssl_ca_cert).read_bytes() == b"not a real CA"


def test_an_inline_client_certificate_is_accepted() -> None:
    cert = base64.b64encode(b"cert").decode()
    got = kubeconfig_configuration(config(user={"client-certificate-data": cert,
                                                "client-key-data": cert}), "here")
    assert Path(got.cert_file).read_bytes() == b"cert"


@pytest.mark.parametrize(("user", "key"), [
    ({"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "sh",
               "args": ["-c", "cat /var/run/secrets/kubernetes.io/serviceaccount/token"]}},
     "exec"),
    ({"auth-provider": {"name": "gcp", "config": {"cmd-path": "/bin/sh"}}}, "auth-provider"),
    ({"tokenFile": "/var/run/secrets/kubernetes.io/serviceaccount/token"}, "tokenFile"),
    ({"client-certificate": "/etc/dcr/tls/tls.crt", "client-key": "/etc/dcr/tls/tls.key"},
     "client-certificate"),
    ({"token": TOKEN, "as": "system:admin"}, "as"),
    ({"username": "admin", "password": "pw"}, "password"),
])
def test_a_user_that_runs_a_command_or_reads_a_file_is_refused(user: dict[str, Any], key: str
                                                              ) -> None:
    with pytest.raises(InvalidResource, match=f"'{key}'") as e:
        kubeconfig_configuration(config(user=user), "Secret ns/train key 'kubeconfig'")
    assert "Secret ns/train" in str(e.value)
    assert TOKEN not in str(e.value)
    assert "serviceaccount" not in str(e.value)  # values are never quoted back


@pytest.mark.parametrize(("cluster", "match"), [
    ({"certificate-authority": "/etc/ssl/private/ca.pem"}, "'certificate-authority'"),
    ({"insecure-skip-tls-verify": True}, "'insecure-skip-tls-verify'"),
    ({"proxy-url": "http://10.0.0.9:3128"}, "'proxy-url'"),
    ({"server": "http://10.1.2.3:6443"}, "https://"),
])
def test_a_cluster_without_tls_or_with_file_paths_is_refused(cluster: dict[str, Any],
                                                             match: str) -> None:
    with pytest.raises(InvalidResource, match=match):
        kubeconfig_configuration(config(cluster=cluster), "here")


@pytest.mark.parametrize(("text", "match"), [
    ("{not yaml", "is not YAML"),
    ("- a list", "current-context"),
    (config({"current-context": "nowhere"}), "context 'nowhere' is not defined once"),
    (config(user={}), "neither a token nor a client certificate"),
])
def test_a_document_that_is_not_a_usable_kubeconfig_is_refused(text: str, match: str) -> None:
    with pytest.raises(InvalidResource, match=match):
        kubeconfig_configuration(text, "here")


def test_a_profile_names_at_most_one_of_warm_encoders_and_a_cluster() -> None:
    with pytest.raises(ValidationError, match="at most one of endpoint"):
        RolloutFleetSpec.model_validate({
            "selector": {"matchLabels": {"app": "r"}},
            "agent": {"tokenSecretRef": {"name": "tok"}}, "initial": {"checkpoint": "/c"},
            "store": {"uri": "s3://b/p"},
            "encoderProfiles": [{"name": "train",
                                 "endpoint": {"urls": ["http://e:8480"],
                                              "tokenSecretRef": {"name": "t"}},
                                 "cluster": {"kubeconfigSecretRef": {"name": "k"},
                                             "namespace": "encoders"}}]})


def alias_bomb(depth: int) -> str:
    """A kubeconfig of ~60 bytes per level whose server is a list of 10**depth strings,
    written once each level through aliases: cheap to load, huge to render."""
    levels = ['l0: &l0 ["x","x","x","x","x","x","x","x","x","x"]']
    levels += [f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 10)}]" for i in range(1, depth)]
    return "\n".join([*levels, "current-context: t",
                      "contexts: [{name: t, context: {cluster: c, user: u}}]",
                      f"clusters: [{{name: c, cluster: {{server: *l{depth - 1}}}}}]",
                      "users: [{name: u, user: {token: x}}]"]) + "\n"


_BOMB_RUN = """
import resource, sys
from dcr_operator.errors import InvalidResource
from dcr_operator.sites import kubeconfig_configuration
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), hard))
try:
    kubeconfig_configuration(sys.stdin.read(), "Secret ns/train key 'kubeconfig'")
except InvalidResource as e:
    print(e)
"""


def test_a_kubeconfig_of_nested_aliases_is_refused_before_it_expands() -> None:
    """Fails without the alias-refusing loader: ``str(server)`` renders 10**9 strings
    (gigabytes), so the child hits its 256 MiB allowance (MemoryError) or the bound of
    300 s. It runs in a child process with both bounds so that the old code can neither
    hang the suite nor exhaust the machine."""
    bomb = alias_bomb(9)
    assert len(bomb) < 1024  # a Secret of well under a KiB
    done = subprocess.run([sys.executable, "-c", _BOMB_RUN], input=bomb, text=True,
                          capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Secret ns/train key 'kubeconfig' uses YAML anchors or aliases" in done.stdout


@pytest.mark.parametrize(("text", "match"), [
    ("x: &a y\ncurrent-context: t\n", "anchors or aliases"),  # an anchor alone is refused
    (config(user={"token": ["a", "list"]}), "the user's 'token' is not a string"),
    (config(cluster={"tls-server-name": {"a": "map"}}),
     "the cluster's 'tls-server-name' is not a string"),
    (config(cluster={"server": 6443}), "the cluster's 'server' is not a string"),
    (config({"contexts": [{"name": "train", "context": {"cluster": ["c"], "user": "u"}}]}),
     "context's cluster is not named by a string"),
    (config(user={"token": TOKEN, "x" * 70_000: "y"}), r"holds \d+ bytes, more than the 65536"),
])
def test_a_kubeconfig_must_be_plain_small_and_of_strings(text: str, match: str) -> None:
    """Fails without the plain loader, the size bound and the string checks: the anchor
    loads, the list and map reach the library, the oversized document is parsed."""
    with pytest.raises(InvalidResource, match=match) as e:
        kubeconfig_configuration(text, "Secret ns/train key 'kubeconfig'")
    assert str(e.value).startswith("Secret ns/train key 'kubeconfig'")
    assert TOKEN not in str(e.value)
