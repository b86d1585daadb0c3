"""The operator speaking TLS to a fleet's agents (the chart's ``tls.enabled``).

With a CA bundle configured, a fleet whose ``agent.scheme`` is ``http`` gets no client:
its status and the refit say which field to change, and no token is sent in clear.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.errors import InvalidResource
from dcr_operator.fleet import clients
from dcr_operator.reconcile import Receiver

TOKEN = "fleet-tls-agent-token-0123456789"


class SecretOnly:
    """A KubeClient that holds one labelled agent-token Secret (our seam's fake)."""

    def get(self, path: str, **_: str) -> dict[str, Any]:
        assert path.endswith("/secrets/tok"), path
        return {"metadata": {"labels": {"dcr.dev/agent-token": "true"}},
                "data": {"token": base64.b64encode(TOKEN.encode()).decode()}}


def spec(scheme: str) -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate({
        "selector": {"matchLabels": {"app": "r"}},
        "agent": {"scheme": scheme, "tokenSecretRef": {"name": "tok"}},
        "store": {"uri": "s3://b/p"}, "initial": {"checkpoint": "/ckpt/v0"}})


def test_with_tls_on_an_http_agent_scheme_is_refused_naming_the_field(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the refusal the operator would build the client and send the token in
    clear at its first call."""
    monkeypatch.setenv("DCR_TLS_CA", str(tmp_path / "ca.crt"))
    kube: Any = SecretOnly()
    with pytest.raises(InvalidResource, match=r"is plain HTTP.*Set spec\.agent\.scheme: https"):
        clients(kube, "rl", spec("http"), [Receiver(name="p0", url="http://10.0.0.7:8471")])
    (c,) = clients(kube, "rl", spec("https"), [Receiver(name="p0", url="https://10.0.0.7:8471")])
    assert c.url == "https://10.0.0.7:8471"
