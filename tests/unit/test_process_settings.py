"""The settings of ``dcr agent``, ``dcr relay`` and ``dcr refit``: the command line is
generated from them, the flags users type keep their meaning, and contradictions are
refused with an error that names the values."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dcr.cli import build_parser, relay_settings
from dcr.errors import ConfigError
from dcr.protocol.coordinator import CoordinatorSettings
from dcr.receiver.settings import AgentSettings
from dcr.refit.job import LAUNCHED, RefitSettings
from dcr.refit.trainer import TrainerSettings
from dcr.settings import MiB, from_args, to_argv
from dcr.transport.relay.settings import RelaySettings
from dcr.transport.s3 import S3Settings


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(argv[0]).parse_args(list(argv))


ENGINE = {"engine_url": "http://127.0.0.1:8000", "staging_dir": Path("/staging"),
          "canonical": Path("/ckpt/v0")}
ENGINE_FLAGS = ("--engine-url", "http://127.0.0.1:8000", "--staging-dir", "/staging",
                "--canonical", "/ckpt/v0")


def test_agent_settings_survive_their_own_argv() -> None:
    s = AgentSettings(name="a", state_dir=Path("/s"), relay="http://r:1",
                      relay_token_file=Path("/t"), engine="sglang", pause_mode="keep",
                      engine_api_key_file=Path("/k"), staging_bytes=64 * MiB,
                      **ENGINE)  # type: ignore[arg-type]
    assert from_args(AgentSettings, parse("agent", *to_argv(s))) == s


def test_agent_flags_users_type_keep_their_meaning() -> None:
    ns = parse("agent", "--name", "r0", "--state-dir", "/s", "--store", "file:///x",
               *ENGINE_FLAGS, "--model-version=3", "--staging-mib", "16", "--listen",
               "0.0.0.0:8471")
    s = from_args(AgentSettings, ns)
    assert (s.store, s.relay, s.model_version, s.staging_bytes, s.listen, s.engine,
            s.pause_mode, s.dense_root) == (
        "file:///x", None, 3, 16 * MiB, "0.0.0.0:8471", "vllm", "wait", Path("/ckpt"))


@pytest.mark.parametrize("moved", ["--model", "--runtime", "--tp-size", "--tp-rank", "--fp8"])
def test_the_engines_options_are_dcr_serves_not_the_agents(moved: str) -> None:
    with pytest.raises(SystemExit):
        parse("agent", "--name", "r0", "--state-dir", "/s", "--store", "s", *ENGINE_FLAGS,
              moved, "1")


def test_an_agent_needs_a_source_and_may_take_a_relay_with_its_store() -> None:
    """A relay fleet's agent reads attempts from its node and the history from the store."""
    base = ("agent", "--name", "r0", "--state-dir", "/s", *ENGINE_FLAGS)
    with pytest.raises(ConfigError, match="give --store, --relay, or both"):
        AgentSettings(name="r0", state_dir=Path("/s"), staging_dir=Path("/st"),
                      canonical=Path("/c"), engine_url="http://e:1")
    ns = parse(*base, "--store", "s", "--relay", "http://r:1")
    assert (ns.store, ns.relay) == ("s", "http://r:1")


@pytest.mark.parametrize(("given", "named"), [
    ({}, "give --store, --relay, or both"),
    ({"store": "s", "engine": "sglang"}, "give --pause-mode abort or keep"),
    ({"store": "s", "engine_url": "unix:///x"}, "'unix:///x' is not an http"),
    ({"store": "s", "listen": "nowhere"}, "'nowhere'"),
    ({"store": "s", "staging_bytes": 0}, "staging_bytes=0"),
])
def test_agent_settings_refuse_contradictions_naming_the_values(
        given: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        AgentSettings(name="a", state_dir=Path("/s"), **{**ENGINE, **given})


def test_relay_flags_users_type_keep_their_meaning(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("0123456789abcdef\n")
    (tmp_path / "publish").write_text("fedcba9876543210\n")
    ns = parse("relay", "--listen", "0.0.0.0:8470", "--members", "a:1, b:2,c:3", "--index",
               "1", "--fanout", "3", "--token-file", str(tmp_path / "token"),
               "--publish-token-file", str(tmp_path / "publish"), "--spool",
               str(tmp_path), "--budget-mib", "4", "--spool-budget-mib", "8",
               "--admit-timeout-s", "1.5", "--health-timeout-s", "2")
    s = relay_settings(ns)
    assert s == RelaySettings(
        members=("a:1", "b:2", "c:3"), index=1, fanout=3, token="0123456789abcdef",
        publish_token="fedcba9876543210", listen="0.0.0.0:8470", spool_dir=tmp_path,
        budget_bytes=4 * MiB, spool_budget_bytes=8 * MiB, admit_timeout_s=1.5,
        health_timeout_s=2.0)
    assert "0123456789abcdef" not in repr(s)
    assert "fedcba9876543210" not in repr(s)


def test_relay_refuses_an_unreadable_token_file_naming_it(tmp_path: Path) -> None:
    (tmp_path / "publish").write_text("fedcba9876543210\n")
    ns = parse("relay", "--listen", "h:1", "--members", "h:1", "--index", "0",
               "--token-file", str(tmp_path / "missing"),
               "--publish-token-file", str(tmp_path / "publish"))
    with pytest.raises(ConfigError, match="missing"):
        relay_settings(ns)


def test_refit_owners_default_to_two_through_the_store_or_the_relay() -> None:
    assert RefitSettings().owners == 2
    assert RefitSettings().owner_form == "warm"
    assert RefitSettings(transport="relay").owners == 2  # the relay carries every part
    with pytest.raises(ConfigError, match="--agents 1"):
        RefitSettings(agents=1)


def test_refit_flags_set_the_job_and_its_trainer() -> None:
    ns = parse("refit", "--out", "o", "--steps", "2", "--agents", "2", "--transport", "relay",
               "--kill-receiver-every", "2", "--seed", "5", "--lr", "1e-5")
    s = from_args(RefitSettings, ns, trainer=from_args(TrainerSettings, ns))
    assert (s.out, s.steps, s.agents, s.owners, s.transport, s.kill_receiver_every) == (
        Path("o"), 2, 2, 2, "relay", 2)
    assert s.trainer == TrainerSettings(seed=5, lr=1e-5)
    assert s.owner_form == "warm"
    ns = parse("refit", "--owner-form", "process")
    assert from_args(RefitSettings, ns, trainer=TrainerSettings()).owner_form == "process"


def test_refit_emulates_a_boundary_by_default_and_refuses_a_negative_link() -> None:
    s = RefitSettings()
    assert (s.store_kind, s.link_mbit, s.rtt_ms) == ("s3", 200.0, 20.0)
    with pytest.raises(ConfigError, match="--link-mbit -1"):
        RefitSettings(link_mbit=-1)
    with pytest.raises(ConfigError, match="--rtt-ms -5"):
        RefitSettings(rtt_ms=-5)
    ns = parse("refit", "--store-kind", "file", "--link-mbit", "50", "--rtt-ms", "80",
               "--hidden-size", "128", "--intermediate-size", "344", "--layers", "2")
    s = from_args(RefitSettings, ns, trainer=from_args(TrainerSettings, ns))
    assert (s.store_kind, s.link_mbit, s.rtt_ms) == ("file", 50.0, 80.0)
    assert (s.trainer.hidden_size, s.trainer.intermediate_size, s.trainer.layers) == (
        128, 344, 2)


def test_the_main_job_starts_agents_with_argv_built_from_their_settings() -> None:
    s = AgentSettings(name="agent-1", state_dir=Path("/s"), store="file:///x",
                      **ENGINE)  # type: ignore[arg-type]
    argv = to_argv(s, skip=LAUNCHED)
    assert not {"--name", "--listen", "--state-dir", "--token-file"} & set(argv)
    assert argv[argv.index("--staging-mib") + 1] == str(s.staging_bytes // MiB)


@pytest.mark.parametrize(("cls", "given", "named"), [
    (TrainerSettings, {"heads": 3}, "heads=3"),
    (CoordinatorSettings, {"max_attempts": 0}, "max_attempts=0"),
    (S3Settings, {"max_attempts": 0}, "max_attempts = 0"),
    (RelaySettings, {"members": ("a:1",), "index": 0, "token": "0123456789abcdef",
                     "publish_token": "fedcba9876543210", "retries": -1}, "retries=-1"),
])
def test_settings_refuse_bad_values_naming_them(cls: type, given: dict[str, object],
                                                named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        cls(**given)


def test_settings_refuse_unknown_keys() -> None:
    with pytest.raises(TypeError, match="bucket"):
        AgentSettings(name="a", state_dir=Path("/s"), store="s", bucket=1,
                      **ENGINE)  # type: ignore[arg-type]
