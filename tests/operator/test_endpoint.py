"""Warm encoder endpoints in the operator: the CRD field, the owner split, and the owner
handle against stand-ins that answer what a test says.

:class:`~dcr_operator.endpoint.EndpointOwner` must ask for what an encoder Job's ``dcr
encode`` gets, carry the token to that URL and nowhere else (no redirect), say why a
publish failed in the attempt's words, and stop the attempt on every endpoint when one
owner fails (refused, no answer by the deadline, or payloads in another store).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError
from stubs import Stub, stubs

from dcr.format.profile import ReceiverProfile
from dcr.protocol.records import Attempt, Transition
from dcr_operator.api.generate import fleet_crd
from dcr_operator.api.rolloutfleet import EncoderEndpoint, RolloutFleetSpec
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.endpoint import EncoderEndpoints, EndpointOwner, encoder_endpoint
from dcr_operator.errors import EncoderEndpointFailed, InvalidResource

TOKEN = "endpoint-owner-test-token-0123456789"
STORE = "s3://rl-weights/policy-a"
FLEET_SPEC: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "r"}}, "agent": {"tokenSecretRef": {"name": "tok"}},
    "store": {"uri": STORE}, "initial": {"checkpoint": "/ckpt/v0"}}
SUMMARY = {"attempt": "a-0123456789ab", "payloads": 2, "payload_bytes": 10, "store": STORE}
JSON = {"Content-Type": "application/json"}


def fleet(*urls: str, name: str = "warm") -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate({**FLEET_SPEC, "encoderProfiles": [
        {"name": "pods"},
        {"name": name, "endpoint": {"urls": list(urls), "tokenSecretRef": {"name": "enc"}}}]})


def refit(owners: int = 1, profile: str = "warm", **encoder: Any) -> WeightRefitSpec:
    return WeightRefitSpec.model_validate({
        "fleet": "f", "baseVersion": 2, "targetVersion": 3,
        "source": {"checkpoint": "/ckpt/v3"},
        "encoder": {"profile": profile, "owners": owners, **encoder}})


def attempt(seconds: float = 60.0, mode: str = "mixed") -> Attempt:
    return Attempt(transition=Transition(base_version=2, target_version=3), mode=mode,  # type: ignore[arg-type]
                   receivers=("p0",), deadline=time.time() + seconds, owners=2,
                   id="a-0123456789ab")


def endpoints(*urls: str, forced: str | None = None, **kw: Any) -> tuple[EncoderEndpoints,
                                                                           list[Any]]:
    calls: list[Any] = []
    spec = refit(owners=len(urls), bucketMiB=64)
    made = EncoderEndpoints(
        profile_name="warm", endpoint=fleet(*urls).encoder_profiles[1].endpoint,  # type: ignore[arg-type]
        token=TOKEN, spec=spec, base_checkpoint="/ckpt/v2", base_attempt="a-v2", store=STORE,
        profile=ReceiverProfile(tensors={"w": "overwrite"}), forced_mode=forced,  # type: ignore[arg-type]
        on_started=lambda a, p: calls.append(("started", a.id, p)),
        on_finished=lambda a, p, f: calls.append(("finished", a.id, p, f)), **kw)
    return made, calls


def answer(stub: Stub, body: dict[str, Any], status: int = 200) -> None:
    stub.answer = (status, JSON, json.dumps(body).encode())


def posted(stub: Stub) -> list[tuple[str, dict[str, Any]]]:
    return [(path, json.loads(body)) for (path, _), body in zip(stub.seen, stub.bodies,
                                                                 strict=True)]


# --- the CRD field and the owner split ----------------------------------------------------


@pytest.mark.parametrize("urls", [
    [], ["ftp://enc:8472"], ["file:///etc/passwd"], ["http://enc:8472?x=1"],
    ["http://enc:8472/#f"], ["enc:8472"], ["http:// enc"], ["http://e"] * 257,
])
def test_an_endpoint_takes_1_to_256_http_or_https_urls_only(urls: list[str]) -> None:
    with pytest.raises(ValidationError):
        EncoderEndpoint.model_validate({"urls": urls, "tokenSecretRef": {"name": "enc"}})


def test_an_endpoint_with_http_and_https_urls_is_taken_and_in_the_crd_schema() -> None:
    e = EncoderEndpoint.model_validate({"urls": ["http://enc-0.enc:8472",
                                                 "https://10.0.0.7:8472/base"],
                                        "tokenSecretRef": {"name": "enc"}})
    assert e.token_secret_ref.key == "token"
    profile = (fleet_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
               ["spec"]["properties"]["encoderProfiles"]["items"]["properties"])
    urls = profile["endpoint"]["properties"]["urls"]
    assert (urls["minItems"], urls["maxItems"]) == (1, 256)
    assert urls["items"]["pattern"].startswith("^https?://")


def test_a_refit_through_an_endpoint_has_one_owner_per_url() -> None:
    spec = fleet("http://a:1", "http://b:1")
    endpoint = encoder_endpoint(refit(owners=2), spec, "f")
    assert endpoint is not None
    assert endpoint.urls == ["http://a:1", "http://b:1"]
    with pytest.raises(InvalidResource, match=r"set spec\.encoder\.owners to 2"):
        encoder_endpoint(refit(owners=3), spec, "f")
    assert encoder_endpoint(refit(owners=3, profile="pods"), spec, "f") is None
    assert encoder_endpoint(refit(owners=1, profile="default"), spec, "f") is None


# --- the owner handle -------------------------------------------------------------------


def test_a_publish_asks_for_what_a_job_gets_with_the_token_to_that_url_only() -> None:
    with stubs("127.0.0.2", "127.0.0.3") as (e0, e1):
        for stub in (e0, e1):
            answer(stub, SUMMARY)
        made, calls = endpoints(e0.url, e1.url, forced="overwrite")
        a = attempt()
        EndpointOwner(endpoints=made, index=1).publish(a)
        assert e0.seen == []
        ((path, body),) = posted(e1)
        assert path == "/v1/publish"
        assert e1.tokens() == [f"Bearer {TOKEN}"]
        assert body == {"attempt": a.id, "mode": "overwrite", "base_version": 2,
                        "target_version": 3, "owner": 1, "owners": 2, "base": "/ckpt/v2",
                        "target": "/ckpt/v3", "bucket_mib": 64,
                        "profile": {"format": "dcr-receiver-profile", "version": 1,
                                    "tensors": {"w": "overwrite"}},
                        "committed_attempt": "a-v2"}  # a rank owner advances by it
        EndpointOwner(endpoints=made, index=0).publish(a)
        assert calls == [("started", a.id, "warm"), ("finished", a.id, "warm", None)]
        assert made.summaries[(a.id, 0)] == SUMMARY
        assert TOKEN not in repr(made)
        assert TOKEN not in repr(made.clients)


@pytest.mark.parametrize("code", [301, 302, 307, 308])
def test_a_redirect_fails_the_publish_and_the_token_goes_nowhere_else(code: int) -> None:
    with stubs("127.0.0.2", "127.0.0.3") as (enc, elsewhere):
        answer(elsewhere, SUMMARY)
        enc.answer = (code, {"Location": f"{elsewhere.url}/v1/publish"}, b"")
        made, calls = endpoints(enc.url)
        with pytest.raises(EncoderEndpointFailed, match=f"HTTP {code}, a redirect") as e:
            EndpointOwner(endpoints=made, index=0).publish(attempt())
        assert TOKEN not in str(e.value)
        assert elsewhere.seen == []  # neither the publish nor the stop was followed
        assert [p for p, _ in enc.seen] == ["/v1/publish", "/v1/stop"]
        assert calls[-1][0] == "finished"
        assert "redirect" in calls[-1][3]


def test_a_refusal_surfaces_in_our_words_and_stops_the_attempt_everywhere() -> None:
    """What status and Events get is the operator's sentence: the call, the HTTP status
    and an identifier kind. Fails on 0961110, which quoted the encoder's ``error`` text
    there (a file's first bytes, or any JSON an endpoint URL the fleet names answers)."""
    with stubs("127.0.0.2", "127.0.0.3") as (e0, e1):
        said = ("/checkpoints/creds.txt: header length 3271150899513092979 does not fit a "
                "file of 31 bytes")
        answer(e0, {"error": said, "kind": "CheckpointError"}, 400)
        answer(e1, {"attempt": "a-0123456789ab", "stopped": 0, "running": 0})
        made, calls = endpoints(e0.url, e1.url)
        a = attempt()
        with pytest.raises(EncoderEndpointFailed) as e:
            EndpointOwner(endpoints=made, index=0).publish(a)
        assert str(e.value) == f"Owner 0 of attempt {a.id}: Encoder endpoint warm[0] (POST " \
            "/v1/publish) was refused with HTTP 400 (CheckpointError)."
        assert calls == [("started", a.id, "warm"), ("finished", a.id, "warm", str(
            e.value).removeprefix(f"Owner 0 of attempt {a.id}: "))]
        assert posted(e1) == [("/v1/stop", {"attempt": a.id})]  # the other owner stops too
        assert [p for p, _ in e0.seen] == ["/v1/publish", "/v1/stop"]
        made.stop([a.id, a.id])  # a second failing owner: each endpoint was told once
        assert len(e0.seen) + len(e1.seen) == 3


def test_a_publish_that_wrote_to_another_store_fails_the_attempt_at_once() -> None:
    with stubs("127.0.0.2") as (enc,):
        answer(enc, {**SUMMARY, "store": "s3://other-bucket/x"})
        made, _ = endpoints(enc.url)
        with pytest.raises(EncoderEndpointFailed, match="its --store must be the fleet's") as e:
            EndpointOwner(endpoints=made, index=0).publish(attempt())
        assert "other-bucket" not in str(e.value)  # the endpoint's words stay in the log
        assert [p for p, _ in enc.seen] == ["/v1/publish", "/v1/stop"]


def test_no_answer_by_the_attempts_deadline_fails_the_publish_and_stops_it() -> None:
    with stubs("127.0.0.2") as (enc,):
        hold = enc.hold = threading.Event()
        answer(enc, {"attempt": "a-0123456789ab", "stopped": 1, "running": 0})

        def release_once_stopped() -> None:  # the publish waits; the stop lets it go
            while len(enc.seen) < 2 and not hold.is_set():
                time.sleep(0.01)
            hold.set()

        threading.Thread(target=release_once_stopped, daemon=True).start()
        made, _ = endpoints(enc.url)
        a = attempt(seconds=1.0)
        try:
            with pytest.raises(EncoderEndpointFailed, match="got no answer"):
                EndpointOwner(endpoints=made, index=0).publish(a)
        finally:
            hold.set()
        assert posted(enc)[-1] == ("/v1/stop", {"attempt": a.id})


def test_an_unreachable_endpoint_fails_the_publish_naming_it() -> None:
    with stubs("127.0.0.2") as (enc,):
        url = enc.url
    made, _ = endpoints(url)  # nothing listens there any more
    with pytest.raises(EncoderEndpointFailed, match=r"warm\[0\] \(POST /v1/publish\) at "):
        EndpointOwner(endpoints=made, index=0).publish(attempt())
