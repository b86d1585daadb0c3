"""A training loop's client: ask for a refit of a RolloutFleet and wait for it.

::

    from dcr.client import refit

    refit("policy", version=step, checkpoint=f"/ckpt/step-{step}", namespace="rl")

creates the WeightRefit ``<fleet>-v<version>`` (base version ``version - 1`` unless said)
and returns once it commits: synchronous RL. With ``wait="published"`` it returns as soon
as the attempt's encoders have published every payload to the store, so the trainer may
reuse its checkpoint and go on while receivers apply: asynchronous RL; ``handle.wait()``
later returns at the commit. Progress goes to a tqdm bar when stderr is a terminal (one
step per receiver that has applied), to ``on_progress`` when given, nowhere otherwise.

A refit that fails raises :class:`WeightRefitFailed` carrying its Failed condition's reason and
message; one overtaken by the fleet (another checkpoint committed as its target, or the
fleet moved past its base) raises :class:`WeightRefitSuperseded`, a kind of it; one that is
neither committed nor failed when ``timeout_s`` runs out raises :class:`WeightRefitTimeout`
with the phase and condition it was in. Asking again for a refit that exists with the same
spec waits on it (a restarted loop resumes); a different spec under that name is refused.

Built on the official ``kubernetes`` client (``pip install 'dcr[client]'``): its
configuration loaders (kubeconfig, else in-cluster), ``CustomObjectsApi`` and watches.
The trainer needs create, get, list and watch on ``weightrefits`` in its namespace, no
more (``docs/trainer.md``).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dcr.errors import RefitError
from dcr.protocol.states import AttemptState, Phase

GROUP, API_VERSION, PLURAL = "dcr.dev", "v1alpha1", "weightrefits"
SUPERSEDED = ("BaseVersionMismatch", "TargetCommittedElsewhere")  # Failed reasons
PUBLISHED = ("EncoderJobSucceeded", "EncoderEndpointSucceeded")  # Encoding reasons
APPLIED = (AttemptState.FLUSHED.value, AttemptState.COMMITTED.value)  # receivers' states
Until = Literal["created", "published", "committed"]
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class WeightRefitError(RefitError):
    """A refit could not be asked for or waited on."""


class WeightRefitFailed(WeightRefitError):
    """The WeightRefit's Failed condition is True: ``reason`` and ``message`` are its."""

    def __init__(self, name: str, reason: str, message: str) -> None:
        super().__init__(f"WeightRefit {name} failed ({reason}): {message}")
        self.name, self.reason, self.message = name, reason, message


class WeightRefitSuperseded(WeightRefitFailed):
    """The fleet committed past this refit: its target from another checkpoint, or a
    version beyond its base. Usually the loop asks for the next version."""


class WeightRefitTimeout(WeightRefitError):
    """Neither committed nor failed in time; the refit goes on unless deleted."""

    def __init__(self, name: str, timeout_s: float, phase: str, condition: str) -> None:
        super().__init__(f"WeightRefit {name} did not reach the point waited for within "
                         f"{timeout_s:g} s: it is {phase} ({condition}).")
        self.name, self.phase, self.condition = name, phase, condition


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A refit as its status shows it, each time the status changes."""

    name: str
    phase: str  # a Phase
    attempts: int
    receivers: int  # in the latest attempt
    applied: int  # of them, flushed or committed
    bytes: int
    message: str  # the condition that says most about now: its reason and message

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Progress:
        status = obj.get("status") or {}
        states = status.get("receiverStates") or []
        return cls(name=obj["metadata"]["name"], phase=status.get("phase") or Phase.PENDING,
                   attempts=int(status.get("attemptCount") or 0),
                   receivers=int(status.get("receiverCount") or 0),
                   applied=sum(int(s.get("count", 0)) for s in states
                               if s.get("state") in APPLIED),
                   bytes=int(status.get("bytes") or 0), message=_telling(obj))


def _conditions(obj: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in (obj.get("status") or {}).get("conditions") or []}


def _telling(obj: Mapping[str, Any]) -> str:
    """The first true of Failed, Committed, Applying, Encoding, Validated, else the first
    one set, as ``Type/Reason: message``."""
    conds = _conditions(obj)
    for t in ("Failed", "Committed", "Applying", "Encoding", "Validated"):
        c = conds.get(t)
        if c is not None and c.get("status") == "True":
            return f"{t}/{c.get('reason', '')}: {c.get('message', '')}"
    c = next(iter(conds.values()), None)
    return "no condition yet" if c is None else (
        f"{c.get('type')}={c.get('status')}/{c.get('reason', '')}: {c.get('message', '')}")


def _reached(obj: Mapping[str, Any], until: Until) -> bool:
    """Whether ``obj`` has got as far as ``until``; raises if it failed."""
    conds = _conditions(obj)
    failed = conds.get("Failed")
    if failed is not None and failed.get("status") == "True":
        name, reason = obj["metadata"]["name"], str(failed.get("reason", ""))
        kind = WeightRefitSuperseded if reason in SUPERSEDED else WeightRefitFailed
        raise kind(name, reason, str(failed.get("message", "")))
    committed = conds.get("Committed", {}).get("status") == "True"
    if until == "committed" or committed:
        return committed
    if until == "published":
        encoding = conds.get("Encoding", {})
        return encoding.get("status") == "False" and encoding.get("reason") in PUBLISHED
    return True


class Refit:
    """One WeightRefit, asked for by :func:`refit`: wait on it, read it."""

    def __init__(self, api: Any, namespace: str, name: str, *,
                 on_progress: Callable[[Progress], object] | None, bar: bool) -> None:
        self._api, self.namespace, self.name = api, namespace, name
        self._on_progress, self._bar = on_progress, bar
        self._last: Progress | None = None

    def get(self) -> dict[str, Any]:
        """The WeightRefit object as the API server has it now."""
        return dict(self._api.get_namespaced_custom_object(
            GROUP, API_VERSION, self.namespace, PLURAL, self.name))

    @property
    def progress(self) -> Progress:
        return Progress.of(self.get())

    def wait(self, until: Until = "committed", *, timeout_s: float = 3600.0) -> Refit:
        """Return once the refit has got as far as ``until``; raise :class:`WeightRefitFailed`
        (or :class:`WeightRefitSuperseded`) if it fails, :class:`WeightRefitTimeout` if time runs
        out first."""
        deadline = time.monotonic() + timeout_s
        bar = _Bar(self.name) if self._bar else None
        obj: Mapping[str, Any] = self.get()
        try:
            while True:
                self._report(obj, bar)
                if _reached(obj, until):
                    return self
                left = deadline - time.monotonic()
                if left <= 0:
                    p = Progress.of(obj)
                    raise WeightRefitTimeout(self.name, timeout_s, p.phase, p.message)
                obj = self._next(obj, left)
        finally:
            if bar is not None:
                bar.close()

    def _next(self, obj: Mapping[str, Any], left: float) -> Mapping[str, Any]:
        """The object's next version, watched from the one in hand; the object itself
        again when the watch ends without a change (its time, or a 410 Gone)."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        w = watch.Watch()  # type: ignore[no-untyped-call]
        try:
            for event in w.stream(  # type: ignore[no-untyped-call]
                    self._api.list_namespaced_custom_object, GROUP, API_VERSION,
                    self.namespace, PLURAL, field_selector=f"metadata.name={self.name}",
                    resource_version=obj["metadata"]["resourceVersion"],
                    timeout_seconds=max(1, min(60, int(left + 0.999)))):
                if event["type"] == "DELETED":
                    raise WeightRefitError(f"WeightRefit {self.name} was deleted while waited on.")
                if event["type"] in ("ADDED", "MODIFIED"):
                    return dict(event["object"])
        except ApiException as e:
            if e.status != 410:  # 410: the version in hand is too old to watch from
                raise WeightRefitError(f"Watching WeightRefit {self.name}: {e.status} "
                                 f"{e.reason}") from e
        finally:
            w.stop()  # type: ignore[no-untyped-call]
        return self.get()

    def _report(self, obj: Mapping[str, Any], bar: _Bar | None) -> None:
        p = Progress.of(obj)
        if p == self._last:
            return
        self._last = p
        if bar is not None:
            bar.show(p)
        if self._on_progress is not None:
            self._on_progress(p)


class _Bar:
    """A tqdm bar of receivers applied, its description the phase."""

    def __init__(self, name: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(desc=name, unit="receiver", total=0, file=sys.stderr, leave=True)

    def show(self, p: Progress) -> None:
        self._bar.total = p.receivers
        self._bar.n = p.applied
        self._bar.set_postfix_str(f"{p.phase}, attempt {p.attempts}, {p.bytes:,} B",
                                  refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def refit(fleet: str, version: int, checkpoint: str, *, namespace: str = "default",
          base_version: int | None = None, name: str | None = None,
          encoder_profile: str | None = None, owners: int | None = None,
          wait: Until = "committed", timeout_s: float = 3600.0,
          on_progress: Callable[[Progress], object] | None = None,
          progress_bar: bool | None = None, api_client: Any = None,
          extra_spec: Mapping[str, Any] | None = None) -> Refit:
    """Ask for a refit of ``fleet`` to ``version`` from ``checkpoint`` and wait as
    ``wait`` says (``created``: not at all). ``progress_bar`` defaults to whether stderr
    is a terminal; ``api_client`` to one from the kubeconfig or the pod's service account.
    ``extra_spec`` adds WeightRefit spec fields (``modePolicy``, ``retryLimit``,
    ``deadlineSeconds``, ...) as the CRD names them."""
    if version < 1:
        raise WeightRefitError(f"version must be at least 1, got {version}.")
    base = version - 1 if base_version is None else base_version
    if not 0 <= base < version:
        raise WeightRefitError(f"base_version must be in [0, {version}), got {base}.")
    name = name or f"{fleet}-v{version}"
    if len(name) > 253 or not _NAME.match(name):
        raise WeightRefitError(f"{name!r} is not a valid WeightRefit name (a DNS subdomain).")
    api = _custom_objects(api_client)
    spec: dict[str, Any] = {"fleet": fleet, "targetVersion": version, "baseVersion": base,
                            "source": {"checkpoint": checkpoint}}
    encoder = {k: v for k, v in (("profile", encoder_profile), ("owners", owners))
               if v is not None}
    if encoder:
        spec["encoder"] = encoder
    spec.update(extra_spec or {})
    _create_or_attach(api, namespace, name, spec)
    handle = Refit(api, namespace, name, on_progress=on_progress,
                   bar=sys.stderr.isatty() if progress_bar is None else progress_bar)
    return handle if wait == "created" else handle.wait(wait, timeout_s=timeout_s)


def _custom_objects(api_client: Any) -> Any:
    from kubernetes import client, config

    if api_client is None:
        try:
            config.load_config()  # type: ignore[no-untyped-call]
        except config.ConfigException as e:
            raise WeightRefitError(f"No Kubernetes configuration found (kubeconfig or in-cluster): "
                             f"{e}") from e
        api_client = client.ApiClient()
    return client.CustomObjectsApi(api_client)


def _create_or_attach(api: Any, namespace: str, name: str, spec: Mapping[str, Any]) -> None:
    from kubernetes.client.exceptions import ApiException

    body = {"apiVersion": f"{GROUP}/{API_VERSION}", "kind": "WeightRefit",
            "metadata": {"name": name, "namespace": namespace}, "spec": dict(spec)}
    try:
        api.create_namespaced_custom_object(GROUP, API_VERSION, namespace, PLURAL, body)
        return
    except ApiException as e:
        if e.status != 409:
            raise WeightRefitError(f"Creating WeightRefit {namespace}/{name}: {e.status} "
                             f"{e.reason}: {_said(e)}") from e
    held = api.get_namespaced_custom_object(GROUP, API_VERSION, namespace, PLURAL,
                                            name)["spec"]
    differ = sorted(k for k in spec if held.get(k) != _with_defaults(spec, held)[k])
    if differ:
        raise WeightRefitError(f"WeightRefit {namespace}/{name} exists with another spec "
                         f"({', '.join(differ)} differ): name the refit, or delete that one.")


def _with_defaults(spec: Mapping[str, Any], held: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` as the API server stores it: fields it defaults (the encoder's) filled
    from what it holds, where ``spec`` leaves them out."""
    out = dict(spec)
    if "encoder" in out and isinstance(held.get("encoder"), Mapping):
        out["encoder"] = {**held["encoder"], **out["encoder"]}
    return out


def _said(e: Any) -> str:
    """The API server's own message in an error, without its whole body."""
    import json

    try:
        return str(json.loads(e.body).get("message", ""))[:500]
    except (TypeError, ValueError, AttributeError):
        return str(e.reason)

