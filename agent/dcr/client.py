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
with the phase and condition it was in. ``timeout_s`` is the caller's deadline for the whole
call: the API server not answering (refused or dropped connections, timeouts, 429 and 5xx
answers) is retried with backoff until then, a dropped watch resumes from the last
resourceVersion seen (a 410 Gone reads the object again), and only when the deadline
passes without an answer does :class:`WeightRefitUnreachable` name the call and the last
error; any other refusal raises :class:`WeightRefitRefused` with its status. Asking again
for a refit that exists with the same spec waits on it (a restarted loop resumes); a
different spec under that name is refused.

Built on the official ``kubernetes`` client (``pip install 'dcr[client]'``): its
configuration loaders (kubeconfig, else in-cluster), ``CustomObjectsApi`` and watches.
The trainer needs create, get, list and watch on ``weightrefits`` in its namespace, no
more (``docs/trainer.md``).

Which refit made a sample: an engine asked for ``return_weight_versions`` answers each
choice's ``weight_versions``, spans ``[{version, start, end}]`` over its output tokens
(vLLM 0.33's field; ``dcr serve`` the same, streamed or not; SGLang's spans through
:func:`dcr.drivers.sglang.weight_versions`). DCR labels the weights with the committed
version as it commits, before the gate reopens, so :func:`token_versions` gives the
version that computed each token, and :func:`sample_commits` names each version's
commit as the store's history holds it (its attempt and the digests of that attempt's
manifest parts), read from the history the fleet's ``status.commit.historyDigest`` vouches
for (:func:`read_history`).
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from dcr.drivers import sglang
from dcr.errors import ManifestError, RefitError
from dcr.format.history import History
from dcr.format.names import DIGEST_PATTERN, object_digest
from dcr.protocol.states import AttemptState, Phase

GROUP, API_VERSION, PLURAL = "dcr.dev", "v1alpha1", "weightrefits"
SUPERSEDED = ("BaseVersionMismatch", "TargetCommittedElsewhere")  # Failed reasons
PUBLISHED = ("EncoderJobSucceeded", "EncoderEndpointSucceeded")  # Encoding reasons
APPLIED = (AttemptState.FLUSHED.value, AttemptState.COMMITTED.value)  # receivers' states
Until = Literal["created", "published", "committed"]
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
RETRY_FIRST_S = 0.5  # the first wait after the API server did not answer; doubles per retry
RETRY_MAX_S = 8.0  # the longest wait between retries: an API server restart takes seconds
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})  # answers worth asking again
log = logging.getLogger(__name__)
T = TypeVar("T")


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


class WeightRefitUnreachable(WeightRefitError):
    """The API server gave no answer (or only 429 and 5xx ones) to ``call`` until the
    caller's deadline; ``last`` is the last error seen."""

    def __init__(self, call: str, seconds: float, last: BaseException) -> None:
        super().__init__(f"{call}: the API server did not answer for {seconds:.1f} s, until "
                         f"the deadline; last: {_short(last)}.")
        self.call, self.last = call, last


class WeightRefitRefused(WeightRefitError):
    """The API server refused ``call`` (403, 404, 422...): ``status`` is its HTTP status."""

    def __init__(self, call: str, status: int, reason: str, said: str) -> None:
        super().__init__(f"{call}: {status} {reason}{': ' + said if said else ''}")
        self.call, self.status = call, status


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

    def get(self, *, timeout_s: float = 60.0) -> dict[str, Any]:
        """The WeightRefit object as the API server has it now (asked again with backoff
        for up to ``timeout_s`` while the API server does not answer)."""
        return self._get(time.monotonic() + timeout_s)

    def _get(self, deadline: float) -> dict[str, Any]:
        call = f"Reading WeightRefit {self.namespace}/{self.name}"
        try:
            return dict(_call(call, deadline, lambda: self._api.get_namespaced_custom_object(
                GROUP, API_VERSION, self.namespace, PLURAL, self.name,
                _request_timeout=_request_timeout(deadline))))
        except WeightRefitError:
            raise
        except Exception as e:
            raise _refused(call, e) from e

    @property
    def progress(self) -> Progress:
        return Progress.of(self.get())

    def wait(self, until: Until = "committed", *, timeout_s: float = 3600.0) -> Refit:
        """Return once the refit has got as far as ``until``; raise :class:`WeightRefitFailed`
        (or :class:`WeightRefitSuperseded`) if it fails, :class:`WeightRefitTimeout` if time runs
        out first; :class:`WeightRefitUnreachable` if the API server gave no answer until
        then."""
        return self._wait(until, timeout_s, time.monotonic() + timeout_s)

    def _wait(self, until: Until, timeout_s: float, deadline: float) -> Refit:
        bar = _Bar(self.name) if self._bar else None
        backoff = _Backoff(f"Watching WeightRefit {self.namespace}/{self.name}", deadline)
        obj: Mapping[str, Any] = self._get(deadline)
        try:
            while True:
                self._report(obj, bar)
                if _reached(obj, until):
                    return self
                left = deadline - time.monotonic()
                if left <= 0:
                    backoff.give_up()  # the watch went unanswered to the end: say so
                    p = Progress.of(obj)
                    raise WeightRefitTimeout(self.name, timeout_s, p.phase, p.message)
                try:
                    obj = self._next(obj, left, deadline)
                except Exception as e:  # a dropped watch: watched again from ``obj``
                    if not _transient(e):
                        raise
                    backoff.wait(e)
                    continue
                backoff.reset()
        finally:
            if bar is not None:
                bar.close()

    def _next(self, obj: Mapping[str, Any], left: float, deadline: float
              ) -> Mapping[str, Any]:
        """The object's next version, watched from the one in hand; the object read again
        when the watch ends without a change (its time, or a 410 Gone: the version in
        hand is too old to watch from). A dropped watch raises what dropped it."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        w = watch.Watch()  # type: ignore[no-untyped-call]
        seconds = max(1, min(60, int(left + 0.999)))
        try:
            for event in w.stream(  # type: ignore[no-untyped-call]
                    self._api.list_namespaced_custom_object, GROUP, API_VERSION,
                    self.namespace, PLURAL, field_selector=f"metadata.name={self.name}",
                    resource_version=obj["metadata"]["resourceVersion"],
                    timeout_seconds=seconds, _request_timeout=(10.0, seconds + 10.0)):
                if event["type"] == "DELETED":
                    raise WeightRefitError(f"WeightRefit {self.name} was deleted while waited on.")
                if event["type"] in ("ADDED", "MODIFIED"):
                    return dict(event["object"])
        except ApiException as e:
            if e.status != 410 and not _transient(e):
                raise _refused(f"Watching WeightRefit {self.namespace}/{self.name}", e) from e
            if e.status != 410:
                raise
        finally:
            w.stop()  # type: ignore[no-untyped-call]
        return self._get(deadline)

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
    deadline = time.monotonic() + timeout_s
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
    _create_or_attach(api, namespace, name, spec, deadline)
    handle = Refit(api, namespace, name, on_progress=on_progress,
                   bar=sys.stderr.isatty() if progress_bar is None else progress_bar)
    return handle if wait == "created" else handle._wait(wait, timeout_s, deadline)


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


def _create_or_attach(api: Any, namespace: str, name: str, spec: Mapping[str, Any],
                      deadline: float) -> None:
    """Create the WeightRefit, or attach to one of the same spec (also what a create
    whose answer was lost, asked again, finds)."""
    from kubernetes.client.exceptions import ApiException

    body = {"apiVersion": f"{GROUP}/{API_VERSION}", "kind": "WeightRefit",
            "metadata": {"name": name, "namespace": namespace}, "spec": dict(spec)}
    call = f"Creating WeightRefit {namespace}/{name}"
    try:
        _call(call, deadline, lambda: api.create_namespaced_custom_object(
            GROUP, API_VERSION, namespace, PLURAL, body,
            _request_timeout=_request_timeout(deadline)))
        return
    except ApiException as e:
        if e.status != 409:
            raise _refused(call, e) from e
    held = Refit(api, namespace, name, on_progress=None, bar=False)._get(deadline)["spec"]
    differ = sorted(k for k in spec if held.get(k) != _with_defaults(spec, held)[k])
    if differ:
        raise WeightRefitError(f"WeightRefit {namespace}/{name} exists with another spec "
                         f"({', '.join(differ)} differ): name the refit, or delete that one.")


def _transient(e: BaseException) -> bool:
    """Whether ``e`` says the API server did not answer (a refused, reset or dropped
    connection, a timeout, a 429 or 5xx answer): worth asking again."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError as TransportError

    if isinstance(e, ApiException):
        return not e.status or e.status in TRANSIENT_STATUS
    return isinstance(e, TransportError | http.client.HTTPException | OSError)


def _refused(call: str, e: BaseException) -> WeightRefitError:
    """A refusal the API server answered, as our error (anything else raised in process
    is wrapped with its own words)."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(e, ApiException):
        return WeightRefitRefused(call, int(e.status or 0), str(e.reason or ""), _said(e))
    return WeightRefitError(f"{call}: {_short(e)}")


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def _request_timeout(deadline: float) -> float:
    """Seconds one call may wait for its answer: at most 30, never past the deadline."""
    return max(1.0, min(30.0, deadline - time.monotonic()))


def _call(call: str, deadline: float, fn: Callable[[], T]) -> T:
    """``fn()``, asked again with backoff while the API server does not answer; anything
    else it raises as it is."""
    backoff = _Backoff(call, deadline)
    while True:
        try:
            return fn()
        except Exception as e:
            if not _transient(e):
                raise
            backoff.wait(e)


class _Backoff:
    """Waits between retries of one call: ``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``,
    never past the deadline; past it, :class:`WeightRefitUnreachable`."""

    def __init__(self, call: str, deadline: float) -> None:
        self.call, self.deadline = call, deadline
        self.reset()

    def reset(self) -> None:
        self.delay: float = RETRY_FIRST_S
        self.since: float | None = None  # when the call first went unanswered
        self.last: BaseException | None = None  # what it last raised

    def give_up(self) -> None:
        """At the deadline: :class:`WeightRefitUnreachable` if the call is unanswered."""
        if self.last is not None and self.since is not None:
            raise WeightRefitUnreachable(self.call, time.monotonic() - self.since,
                                         self.last) from self.last

    def wait(self, e: BaseException) -> None:
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        self.last = e
        if self.deadline - now <= 0:
            self.give_up()
        left = self.deadline - now
        pause = min(self.delay, left)
        log.warning("%s: the API server did not answer (%s); asking again in %.1f s",
                    self.call, _short(e), pause)
        time.sleep(pause)
        self.delay = min(2 * self.delay, RETRY_MAX_S)


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



# --- which refit made a sample --------------------------------------------------------


class SampleVersionError(WeightRefitError):
    """An answer's weight versions are missing or malformed, or name no committed refit
    of the history read."""


@dataclass(frozen=True, kw_only=True)
class Span:
    """Output tokens ``[start, end)`` were computed by the weights labelled ``version``."""

    version: str
    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class SampleCommit:
    """A committed refit as the store's history names it: the proof of a sample's weights."""

    version: int
    base_version: int
    attempt: str  # the attempt whose payloads took base_version to version
    manifests: tuple[str, ...]  # BLAKE2b-128 of each owner's manifest part, in order
    history_digest: str  # BLAKE2b-128 of the history that says so


def read_events(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a server-sent-event stream (``data: {...}`` lines), until
    ``data: [DONE]``; an error chunk raises :class:`SampleVersionError` with its message."""
    for raw in lines:
        line = (raw.decode() if isinstance(raw, bytes) else raw).strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if isinstance(chunk, dict) and "error" in chunk:
            raise SampleVersionError(f"The stream ended with an error: {chunk['error']}")
        yield chunk


def weight_versions(answer: Mapping[str, Any] | Iterable[Mapping[str, Any]], *,
                    choice: int = 0) -> list[Span]:
    """The spans of one choice of ``answer``: a JSON answer of vLLM, ``dcr serve`` or
    SGLang, or the chunks of a streamed one (where the last chunk of the choice carries
    them), checked to cover its output tokens from the first, without gap or overlap."""
    chunks = [answer] if isinstance(answer, Mapping) else list(answer)
    raw: Any = None
    count: int | None = 0
    for chunk in chunks:
        got, tokens = _choice_spans(chunk, choice)
        raw = got if got is not None else raw
        if "choices" not in chunk:  # SGLang's /generate: each chunk counts every token
            count = tokens
        else:
            count = None if count is None or tokens is None else count + tokens
    if raw is None:
        raise SampleVersionError(f"Choice {choice} of the answer carries no weight_versions: "
                                 "ask with return_weight_versions: true (vLLM 0.33 or later, "
                                 "dcr serve, SGLang).")
    return _checked(raw, count, choice)


def _choice_spans(chunk: Mapping[str, Any], choice: int) -> tuple[Any, int | None]:
    """One answer or chunk's spans for ``choice`` (None if it has none) and how many
    output tokens it holds (None where it does not say)."""
    if "choices" not in chunk:  # SGLang's /generate
        return sglang.weight_versions(chunk), sglang.output_tokens(chunk)
    for c in chunk.get("choices") or []:
        if isinstance(c, Mapping) and c.get("index", 0) == choice:
            ids = c.get("token_ids")
            spans = c.get("weight_versions")
            if spans is None and choice == 0:  # SGLang's /v1/completions: beside the choices
                spans = sglang.weight_versions(chunk)
            return spans, len(ids) if isinstance(ids, list) else None
    return None, 0


def _checked(raw: Any, count: int | None, choice: int) -> list[Span]:
    spans: list[Span] = []
    for item in raw if isinstance(raw, list) else [raw]:
        ok = isinstance(item, Mapping) and isinstance(item.get("version"), str) and all(
            type(item.get(k)) is int for k in ("start", "end"))
        at = spans[-1].end if spans else 0
        if not ok or item["start"] != at or item["end"] < item["start"]:
            raise SampleVersionError(f"Choice {choice}: weight_versions span {item!r} does not "
                                     f"follow on at token {at} (spans are [{{version, start, "
                                     "end}]: contiguous, from token 0).")
        spans.append(Span(version=item["version"], start=item["start"], end=item["end"]))
    end = spans[-1].end if spans else 0
    if count is not None and end != count:
        raise SampleVersionError(f"Choice {choice}: weight_versions cover {end} tokens; the "
                                 f"answer holds {count}.")
    return spans


def token_versions(answer: Mapping[str, Any] | Iterable[Mapping[str, Any]], *,
                   choice: int = 0) -> list[str]:
    """The weight-version label of each output token of one choice, in order."""
    return [s.version for s in weight_versions(answer, choice=choice)
            for _ in range(s.start, s.end)]


def read_history(store_uri: str, history_digest: str) -> History:
    """The store's history that ``history_digest`` (the fleet's
    ``status.commit.historyDigest``) vouches for; any other is refused."""
    from dcr.files.history import HistoryStore
    from dcr.transport.store import open_store

    if not re.fullmatch(DIGEST_PATTERN, history_digest):
        raise SampleVersionError(f"History digest {history_digest!r} is not 32 hex digits "
                                 "(the fleet's status.commit.historyDigest).")
    return HistoryStore(open_store(store_uri), history_digest).read()


def sample_commits(labels: Iterable[str], history: History) -> dict[str, SampleCommit]:
    """Each distinct label (as :func:`token_versions` gives them) and the commit of its
    version in ``history``; :class:`SampleVersionError` names a label that is no version
    DCR committed there (the weights an engine started with, a label set by hand, a
    version newer than the history read or pruned from it)."""
    digest = history_digest_of(history)
    out: dict[str, SampleCommit] = {}
    for label in dict.fromkeys(labels):
        if not re.fullmatch(r"[0-9]{1,18}", label):
            raise SampleVersionError(f"Weight version {label[:64]!r} is not a version DCR "
                                     "committed: DCR labels the weights with the committed "
                                     "version number.")
        try:
            entry = history.entry(int(label))
        except ManifestError as e:
            raise SampleVersionError(f"Weight version {label}: {e} A newer commit is in a "
                                     "newer history; an older one may be pruned.") from None
        out[label] = SampleCommit(version=entry.version, base_version=entry.base_version,
                                  attempt=entry.attempt,
                                  manifests=tuple(p.digest for p in entry.parts),
                                  history_digest=digest)
    return out


def history_digest_of(history: History) -> str:
    """The digest a history has in the store (what ``historyDigest`` names)."""
    return object_digest(history.pack())
