"""The operator's startup waits until the API server serves its resources: kopf looks them
up once, after the startup handlers, and an operator started during an API server restart
otherwise served nothing for ever (found by the deploy tier's seeded faults)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import kopf
import pytest

from dcr_operator import handlers
from dcr_operator.errors import ApiUnreachable, NotFound

SLEEP = asyncio.sleep
BOTH = {"resources": [{"name": "rolloutfleets"}, {"name": "weightrefits"},
                      {"name": "rolloutfleets/status"}]}


class Discovery:
    """A KubeClient whose discovery answers ``answers`` in turn, then the last again."""

    def __init__(self, *answers: Any) -> None:
        self.answers, self.paths = list(answers), list[str]()

    def get(self, path: str) -> Any:
        self.paths.append(path)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def start(kube: Discovery) -> None:
    wait: Any = handlers.wait_until_the_crds_are_served  # kopf passes more; it takes memo
    asyncio.run(wait(memo=SimpleNamespace(kube=kube)))


def test_startup_waits_through_an_api_server_that_does_not_yet_serve_the_resources(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio, "sleep", _no_wait)
    kube = Discovery(ApiUnreachable("no answer"),
                     NotFound("GET /apis/dcr.dev/v1alpha1: not found", 404),
                     {"resources": [{"name": "rolloutfleets"}]}, BOTH)
    start(kube)
    assert kube.paths == ["/apis/dcr.dev/v1alpha1"] * 4


def test_startup_fails_when_the_resources_are_never_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio, "sleep", _no_wait)
    monkeypatch.setattr(handlers, "CRDS_SERVED_WAIT_S", 0.0)
    with pytest.raises(kopf.PermanentError, match="lists no weightrefits"):
        start(Discovery({"resources": [{"name": "rolloutfleets"}]}))


async def _no_wait(_: float) -> None:
    await SLEEP(0)
