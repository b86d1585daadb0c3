"""DCR's SGLang loader (``dcr.runtimes.sglang.dcr_weight_loader``) fed exactly what the
agent's ``SglangDriver`` sends, on model objects shaped like SGLang's.

SGLang itself does not run here (it pins its own torch and CUDA packages), so a small
aiohttp server plays the part of SGLang 0.5.23 that the contract touches, as its source
does it (``http_server.py``, ``weight_updater.py``): a weight-update session around
``/update_weights_from_tensor``; a ``load_format`` that must be registered with
``--custom-weight-loader`` and is then imported by its qualified name; each TP rank
unpickling its entry with an allow-list of globals, moving every tensor to its device,
and calling ``loader(model, named_tensors)``; ``get_parallel().tp_rank`` read from
``sglang.srt.runtime_context`` (a module put in ``sys.modules`` here). The models are
the two ranks of the vLLM-layout reference at TP 2 (fused qkv and gate_up, row and
column slices, padded vocabulary): objects with ``load_weights`` and
``named_parameters``, as SGLang's models are. Payloads come from the owner's own diff
between checkpoints of real AdamW steps; bits are compared through the plugin's
fingerprint against twins loaded densely through the same loader.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import io
import json
import pickle
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from transformers import LlamaConfig, LlamaForCausalLM

from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.drivers import EngineError, SglangDriver
from dcr.drivers.sglang import LOADER, PICKLE_GLOBALS, call_pickle, result_name
from dcr.format.manifest import Manifest
from dcr.format.names import Mode
from dcr.format.profile import ReceiverProfile
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes import build_runtime
from dcr.runtimes.sglang import dcr_weight_loader
from dcr.runtimes.weights import checkpoint_tensors, runtime_fingerprint
from dcr.settings import MiB
from dcr.transport.store import MemoryStore

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WORLD = 2
LLAMA = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory,
              export_llama_versions: Callable[..., None]) -> Path:
    """Versions 0..2 of a tiny Llama in BF16, one real AdamW step apart; ``other`` is a
    model of another shape."""
    root = tmp_path_factory.mktemp("ckpts")
    export_llama_versions(root, LLAMA)
    other = LlamaConfig(**{**LLAMA.to_dict(), "intermediate_size": 96})
    LlamaForCausalLM(other).to(torch.bfloat16).save_pretrained(root / "other")
    return root


def dense_rank(root: Path, version: str, rank: int) -> Any:
    """One rank of the reference model at TP 2, loaded densely with ``version``."""
    runtime = build_runtime("vllm-ref", root / "v0", tp_size=WORLD, tp_rank=rank)
    with Checkpoint(root / version) as c, torch.no_grad():
        runtime.load_weights(checkpoint_tensors(c).items())
    return runtime


def twin_fingerprints(root: Path, version: str) -> list[dict[str, str]]:
    return [runtime_fingerprint(dense_rank(root, version, r)) for r in range(WORLD)]


def canonical(ckpt: Path) -> list[CanonicalTensor]:
    with Checkpoint(ckpt) as c:
        return [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=i.shape) for i in c]


# --- SGLang, as far as the contract reaches -----------------------------------------------


class AllowListUnpickler(pickle.Unpickler):
    """SGLang's ``SafeUnpickler`` rule: only allow-listed globals."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"blocked {module}.{name}")
        return super().find_class(module, name)


class FakeSglang:
    """SGLang 0.5.23's weight-update path with ``--custom-weight-loader`` set to DCR's
    loader, over one model object per TP rank, on a loopback port."""

    def __init__(self, models: list[Any], parallel: types.SimpleNamespace,
                 loaders: tuple[str, ...] = (LOADER,)) -> None:
        self.models, self.parallel, self.loaders = models, parallel, loaders
        self.session = False
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _update(self, body: dict[str, Any]) -> tuple[bool, str]:
        if not self.session:
            return False, "update_weights_from_tensor must run inside a weight-update session"
        load_format = body.get("load_format")
        if load_format not in self.loaders:
            return False, f"Unknown load_format={load_format}"
        module, _, attr = load_format.rpartition(".")  # SGLang's dynamic_import
        loader = getattr(importlib.import_module(module), attr)
        entries = body["serialized_named_tensors"]
        assert len(entries) == len(self.models)
        for rank, (entry, model) in enumerate(zip(entries, self.models, strict=True)):
            self.parallel.tp_rank = rank  # what each rank's process has published
            named = AllowListUnpickler(io.BytesIO(base64.b64decode(entry))).load()
            device = next(model.parameters()).device
            loader(model, [(n, t.to(device)) for n, t in named])
        return True, "Success"

    def _run(self, ready: threading.Event) -> None:
        def answer(ok: bool, message: str) -> web.Response:
            return web.json_response({"success": ok, "message": message},
                                     status=200 if ok else 400)

        async def begin(_: web.Request) -> web.Response:
            if self.session:
                return answer(False, "a weight-update session is already open")
            self.session = True
            return answer(True, "begun")

        async def end(_: web.Request) -> web.Response:
            was, self.session = self.session, False
            return answer(was, "ended" if was else "no weight-update session is open")

        async def update(request: web.Request) -> web.Response:
            return answer(*self._update(await request.json()))

        async def server_info(_: web.Request) -> web.Response:
            return web.json_response({"tp_size": len(self.models), "dp_size": 1})

        app = web.Application()
        app.add_routes([web.post("/begin_weight_update", begin),
                        web.post("/end_weight_update", end),
                        web.post("/update_weights_from_tensor", update),
                        web.get("/server_info", server_info)])
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def parallel(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """``sglang.srt.runtime_context.get_parallel()`` as SGLang's processes publish it."""
    state = types.SimpleNamespace(tp_rank=0, tp_size=WORLD, pp_size=1)
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_parallel = lambda: state  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    return state


@pytest.fixture
def staging(tmp_path: Path, ckpt_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "staging"
    path.mkdir()
    monkeypatch.setenv("DCR_STAGING_DIR", str(path))
    monkeypatch.setenv("DCR_CHECKPOINT_ROOT", str(ckpt_root))
    return path


@pytest.fixture
def server(ckpt_root: Path, parallel: types.SimpleNamespace, staging: Path
           ) -> Iterator[FakeSglang]:
    models = [dense_rank(ckpt_root, "v0", r).model for r in range(WORLD)]
    fake = FakeSglang(models, parallel)
    yield fake
    fake.close()


def stage(root: Path, staging: Path, base: int, target: int, mode: Mode,
          profile: ReceiverProfile | None) -> tuple[list[str], Manifest]:
    """Diff ``base`` -> ``target`` as an owner would; the payloads written to staging."""
    store = MemoryStore()
    settings = EncodeSettings(target_version=target, base_version=base, mode=mode, profile=profile,
                              bucket_bytes=1 * MiB, attempt_manifest=True)
    with Checkpoint(root / f"v{base}") as b, Checkpoint(root / f"v{target}") as t:
        manifest = diff_checkpoints(b, t, store, settings)
    names = []
    for p in sorted(manifest.payloads, key=lambda p: (p.owner, p.seq)):
        name = f"{manifest.attempt}-o{p.owner:04d}-s{p.seq:06d}.dcrp"
        (staging / name).write_bytes(store.get(p.key))
        names.append(name)
    return names, manifest


def results(staging: Path) -> list[str]:
    return sorted(p.name for p in staging.glob(".dcr-*"))


# --- through the adapter --------------------------------------------------------------------


def test_sglang_loader_refits_both_tp_ranks_bit_exactly_through_the_adapter(
        server: FakeSglang, ckpt_root: Path, staging: Path) -> None:
    engine = SglangDriver(server.url, staging)
    ids = engine.instance().split("-")
    assert len(ids) == WORLD  # one id per rank, each rank saying the world is 2

    profile = engine.prewarm(canonical(ckpt_root / "v0")).profile
    assert set(profile.tensors.values()) == {"xor"}  # BF16 through the reference loader

    names, _ = stage(ckpt_root, staging, 0, 1, "mixed", profile)
    outcome = engine.apply(names)
    assert [r["rank"] for r in outcome.reports] == [0, 1]
    assert all(r["records"] > 0 for r in outcome.reports)
    assert engine.fingerprint() == twin_fingerprints(ckpt_root, "v1")

    for n in names:
        (staging / n).unlink()
    names, manifest = stage(ckpt_root, staging, 1, 2, "overwrite", profile)
    engine.apply(names)
    engine.sync()
    assert engine.fingerprint() == twin_fingerprints(ckpt_root, "v2")
    targets = {t.name: t.target for t in manifest.tensors}
    assert engine.check_targets(targets) == {}
    wrong = "model.norm.weight"  # replicated: both ranks hold it whole
    assert list(engine.check_targets({**targets, wrong: "xxh3-128:" + "0" * 32})) == [wrong]
    engine.check_dense("v1")  # every check, no write
    assert engine.fingerprint() == twin_fingerprints(ckpt_root, "v2")

    engine.load_dense("v0")  # a dense rejoin through the same loader
    assert engine.fingerprint() == twin_fingerprints(ckpt_root, "v0")
    with pytest.raises(EngineError, match=r"DenseRefused: Tensor .* is not the version's"):
        engine.load_dense("v1", expect={t.name: t.target for t in manifest.tensors})
    engine.load_dense("v2", expect={t.name: t.target for t in manifest.tensors})
    assert engine.fingerprint() == twin_fingerprints(ckpt_root, "v2")
    assert results(staging) == []  # every rank's answer read and removed


def test_sglang_loader_failures_come_back_as_answers_naming_the_rank(
        server: FakeSglang, ckpt_root: Path, staging: Path) -> None:
    engine = SglangDriver(server.url, staging)
    before = engine.fingerprint()
    with pytest.raises(EngineError, match=r"apply failed on rank 0: ConfigError: dcr_apply "
                                          "before dcr_prewarm"):
        engine.apply(["nothing.dcrp"])

    engine.prewarm(canonical(ckpt_root / "v0"))
    with pytest.raises(EngineError, match=r"rank 0: ConfigError: Staged payload "
                                          "'missing.dcrp' cannot be opened"):
        engine.apply(["missing.dcrp"])
    with pytest.raises(EngineError, match=r"load_dense failed on rank 0: DenseRefused: "
                                          "Checkpoint 'other' does not hold"):
        engine.load_dense("other")
    assert engine.fingerprint() == before  # nothing was written
    assert not server.session  # every session was closed
    assert results(staging) == []


# --- the loader alone, fed what no adapter sends -------------------------------------------


def call(cid: str, method: str, *args: str) -> list[tuple[str, torch.Tensor]]:
    name = "dcr:" + json.dumps({"call": cid, "method": method, "args": list(args)})
    return AllowListUnpickler(io.BytesIO(call_pickle(name))).load()  # type: ignore[no-any-return]


def answer(staging: Path, cid: str, rank: int = 0) -> dict[str, Any]:
    path = staging / result_name(cid, rank)
    got = json.loads(path.read_text())
    path.unlink()
    assert isinstance(got, dict)
    return got


@pytest.mark.parametrize(("named", "why"), [
    (call("a1", "dcr_apply", json.dumps({"payloads": ["../escape.dcrp"]})),
     "ConfigError: Staged payload name '../escape.dcrp' is not a plain file name"),
    (call("a1", "dcr_apply", json.dumps({"payloads": ["x"], "extra": 1})),
     "ConfigError: ApplyRequest: "),
    (call("a1", "dcr_load_dense", json.dumps({"checkpoint": "../v0"})),
     "ConfigError: Checkpoint '../v0' must be a relative path"),
    (call("a1", "dcr_sync", "{}"), "ConfigError: dcr_sync takes 0 argument"),
    (call("a1", "dcr_prewarm"), "ConfigError: dcr_prewarm takes 1 argument"),
    (call("a1", "__init__"), "ConfigError: SglangCall: "),
    (call("a1", "dcr_sync") * 2, "ConfigError: DCR's loader takes one named tensor"),
    ([('dcr:{"call":"a1","method":"dcr_sync","args":[1]}', torch.empty(0))],
     "ConfigError: SglangCall: "),
])
def test_sglang_loader_answers_a_hostile_call_with_an_error_and_never_raises(
        server: FakeSglang, ckpt_root: Path, staging: Path, named: list[tuple[str, Any]],
        why: str) -> None:
    tensors = [[t.name, t.dtype, list(t.shape)] for t in canonical(ckpt_root / "v0")]
    dcr_weight_loader(server.models[0], call("b0", "dcr_prewarm", json.dumps({"tensors": tensors})))
    assert set(answer(staging, "b0")["profile"].values()) == {"xor"}
    dcr_weight_loader(server.models[0], named)
    got = answer(staging, "a1")
    assert got["rank"] == 0
    assert got["error"].startswith(why)
    assert results(staging) == []


def test_sglang_loader_without_a_usable_call_id_or_staging_dir_writes_nothing(
        server: FakeSglang, staging: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for named in (call("../../x", "dcr_sync"), [('dcr:{"call":"e5","method":', torch.empty(0))],
                  [("model.embed_tokens.weight", torch.zeros(4))]):
        dcr_weight_loader(server.models[0], named)  # nowhere to answer: logged
    assert list(staging.iterdir()) == []
    monkeypatch.delenv("DCR_STAGING_DIR")
    dcr_weight_loader(server.models[0], call("b2", "dcr_sync"))  # does not raise either


def test_sglang_loader_refuses_pipeline_stages(
        server: FakeSglang, staging: Path, parallel: types.SimpleNamespace) -> None:
    parallel.pp_size = 2
    dcr_weight_loader(server.models[0], call("c3", "dcr_instance"))
    error = answer(staging, "c3")["error"]
    assert "supports tensor parallelism only" in error
    assert re.search(r"The SGLang \S+ server runs 2 pipeline stages", error), error


def test_sglang_loader_replaces_a_planted_link_instead_of_writing_through_it(
        server: FakeSglang, staging: Path, tmp_path: Path,
        parallel: types.SimpleNamespace) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (staging / result_name("d4", 1)).symlink_to(victim)
    parallel.tp_rank = 1
    dcr_weight_loader(server.models[1], call("d4", "dcr_sync"))
    assert victim.read_text() == "keep me"
    assert not (staging / result_name("d4", 1)).is_symlink()
    assert answer(staging, "d4", 1) == {"rank": 1}
    assert list(staging.iterdir()) == []  # no temporary file left behind
