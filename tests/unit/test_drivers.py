"""The engine adapters' request mapping, against small aiohttp stubs of each engine's API.

The vLLM stub answers the endpoints of vLLM 0.33's server the way its source does
(``/collective_rpc`` -> ``{"results": [...]}``, ``/pause?mode=``, ``/update_weight_version
{"new_version"}``, ``/weight_info``); the SGLang stub follows SGLang 0.5.23's documented
and source contract: a weight-update session around ``/update_weights_from_tensor``, a
custom ``load_format`` that must be registered, per-rank entries unpickled with an
allow-list of globals, and ``{"success", "message"}`` answers. Both stubs play DCR's
plugin with one answer table (:func:`plugin_answer`); the SGLang one writes each rank's
answer to the staging directory as the real plugin does. Every request is recorded and
the tests assert what each adapter call sent, and how each failure reads.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
import re
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from dcr.apply.plan import CanonicalTensor
from dcr.drivers import BadAnswer, EngineError, SglangDriver, VllmDriver
from dcr.drivers.sglang import LOADER, PICKLE_GLOBALS, call_pickle, result_name
from dcr.errors import ConfigError

KEY = "engine-key-0123456789abcdef"
TENSORS = [CanonicalTensor(name="a.weight", dtype="BF16", shape=(4, 2)),
           CanonicalTensor(name="b.weight", dtype="F32", shape=(3,))]
WORLD = 2


def plugin_answer(method: str, args: list[str], rank: int) -> dict[str, Any]:
    """What DCR's plugin on ``rank`` answers (the contract in dcr.protocol.engine_api)."""
    arg = json.loads(args[0]) if args else None
    if method == "dcr_instance":
        return {"instance": f"{rank:02d}" * 8, "rank": rank, "world": WORLD}
    if method == "dcr_prewarm":  # rank 1 needs absolute values for b: the merge keeps it
        classes = {"a.weight": "xor", "b.weight": "overwrite" if rank else "xor"}
        return {"rank": rank, "profile": {n: classes[n] for n, _, _ in arg["tensors"]}}
    if method == "dcr_apply":
        return {"rank": rank, "names": ["a.weight"], "scatter_s": 0.5 * (rank + 1),
                "loader_s": 0.25, "writes": 3}
    if method == "dcr_fingerprint":
        return {"rank": rank, "tensors": {"a.weight": f"xxh3-128:{rank}"}}
    if method == "dcr_check_targets":  # each rank checks what it holds whole
        return {"rank": rank, "differ": {n: "xxh3-128:7" for n in sorted(arg["expect"])
                                         [rank:rank + 1]}}
    return {"rank": rank}


Routes = dict[tuple[str, str], Callable[[web.Request], Awaitable[web.StreamResponse]]]


class Stub:
    """An aiohttp app on a loopback port, in a thread of its own; records every request
    as ``(method, path, query, headers, JSON body)``."""

    def __init__(self, routes: Routes) -> None:
        self.requests: list[tuple[str, str, dict[str, str], dict[str, str], Any]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(routes,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self, routes: Routes) -> None:
        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            raw = await request.read()
            self.requests.append((request.method, request.path, dict(request.query),
                                  dict(request.headers), json.loads(raw) if raw else None))
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.add_routes([web.route(m, p, h) for (m, p), h in routes.items()])
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.ready.set()
        self.loop.run_forever()

    def calls(self) -> list[tuple[str, str, Any]]:
        return [(m, p + ("?" + "&".join(f"{k}={v}" for k, v in q.items()) if q else ""), b)
                for m, p, q, _, b in self.requests]

    def close(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def stub() -> Iterator[Callable[[Routes], Stub]]:
    made: list[Stub] = []

    def start(routes: Routes) -> Stub:
        made.append(Stub(routes))
        return made[-1]

    yield start
    for s in made:
        s.close()


def answer(body: Any, status: int = 200) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_: web.Request) -> web.Response:
        return web.json_response(body, status=status)
    return handler


# --- vLLM -------------------------------------------------------------------------------


def vllm_routes(state: dict[str, Any]) -> Routes:
    async def rpc(request: web.Request) -> web.Response:
        body = await request.json()
        ranks = [1, 0]  # any order: the adapter sorts by rank
        return web.json_response({"results": [plugin_answer(body["method"], body["args"], r)
                                               for r in ranks]})

    async def version(request: web.Request) -> web.Response:
        state["label"] = (await request.json())["new_version"]
        return web.json_response({"success": True, "new_version": state["label"]})

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": state.get("label")})

    return {("POST", "/collective_rpc"): rpc,
            ("POST", "/pause"): answer({"status": "paused"}),
            ("POST", "/resume"): answer({"status": "resumed"}),
            ("GET", "/is_paused"): answer({"is_paused": True}),
            ("POST", "/update_weight_version"): version,
            ("GET", "/weight_info"): info,
            ("GET", "/health"): answer(None)}


def test_vllm_engine_maps_each_call_onto_vllms_endpoints(stub: Callable[[Routes], Stub]) -> None:
    server = stub(vllm_routes({}))
    engine = VllmDriver(server.url + "/", KEY)

    assert engine.instance() == "00" * 8 + "-" + "01" * 8
    profile = engine.prewarm(TENSORS).profile
    assert profile.tensors == {"a.weight": "xor", "b.weight": "overwrite"}
    outcome = engine.apply(["a-1-o0000-s000000.dcrp", "a-1-o0000-s000001.dcrp"])
    assert [r["rank"] for r in outcome.reports] == [0, 1]
    assert (outcome.seconds, outcome.names) == (1.25, frozenset({"a.weight"}))
    engine.sync()
    assert engine.fingerprint() == [{"a.weight": "xxh3-128:0"}, {"a.weight": "xxh3-128:1"}]
    assert engine.check_targets({"b.weight": "xxh3-128:2", "a.weight": "xxh3-128:1"}) == {
        "a.weight": "xxh3-128:7", "b.weight": "xxh3-128:7"}  # every rank's, merged
    engine.check_dense("v3", {"a.weight": "xxh3-128:9"})
    engine.load_dense("v3", {"a.weight": "xxh3-128:9"})
    engine.pause("keep")
    assert engine.is_paused()
    engine.set_version("3")
    assert engine.version() == "3"
    engine.resume()
    assert engine.health()

    rpc = [(b["method"], b["args"], b["timeout"]) for m, p, b in server.calls()
           if p == "/collective_rpc"]
    t = engine.timeouts
    assert rpc == [
        ("dcr_instance", [], t.call_s),
        ("dcr_prewarm", ['{"tensors":[["a.weight","BF16",[4,2]],["b.weight","F32",[3]]]}'],
         t.prewarm_s),
        ("dcr_apply", ['{"payloads":["a-1-o0000-s000000.dcrp","a-1-o0000-s000001.dcrp"]}'],
         t.apply_s),
        ("dcr_sync", [], t.call_s),
        ("dcr_fingerprint", [], t.call_s),
        ("dcr_check_targets", ['{"expect":{"b.weight":"xxh3-128:2","a.weight":"xxh3-128:1"}}'],
         t.prewarm_s),
        ("dcr_load_dense", ['{"checkpoint":"v3","expect":{"a.weight":"xxh3-128:9"},'
                            '"check_only":true}'], t.dense_s),
        ("dcr_load_dense", ['{"checkpoint":"v3","expect":{"a.weight":"xxh3-128:9"},'
                            '"check_only":false}'], t.dense_s),
    ]
    assert [(m, p, b) for m, p, b in server.calls() if p != "/collective_rpc"] == [
        ("POST", "/pause?mode=keep", None), ("GET", "/is_paused", None),
        ("POST", "/update_weight_version", {"new_version": "3"}), ("GET", "/weight_info", None),
        ("POST", "/resume", None), ("GET", "/health", None)]
    assert {h.get("Authorization") for _, _, _, h, _ in server.requests} == {f"Bearer {KEY}"}


def test_engine_errors_name_the_call_and_quote_only_a_bounded_printable_excerpt(
        stub: Callable[[Routes], Stub]) -> None:
    hostile = "boom\x1b[31m\n" + "x" * (32 << 10)
    elsewhere = stub({("POST", "/collective_rpc"): answer({"results": []})})
    server = stub({
        ("POST", "/collective_rpc"): answer({"error": {"message": hostile, "code": 500}}, 500),
        ("POST", "/pause"): answer({"detail": [{"msg": "Input should be 'abort'"}]}, 422),
        ("POST", "/resume"): answer({"error": "Unauthorized"}, 401),
        ("GET", "/weight_info"): answer({"weight_version": 7}),
    })
    engine = VllmDriver(server.url, KEY)
    with pytest.raises(EngineError) as e:
        engine.apply(["p.dcrp"])
    text = str(e.value)
    assert (e.value.status, e.value.call) == (500, "apply")
    assert text.startswith(f"vLLM engine at {server.url}: apply (POST /collective_rpc) "
                           "answered HTTP 500: boom?[31m xxx")
    assert (len(text) < 400, text.isprintable()) == (True, True)
    with pytest.raises(EngineError, match=r"pause \(POST /pause\?mode=wait\) answered HTTP "
                                          "422: Input should be 'abort'"):
        engine.pause()
    with pytest.raises(EngineError, match="HTTP 401: Unauthorized"):
        engine.resume()
    with pytest.raises(BadAnswer, match="answered a int weight_version"):
        engine.version()

    async def redirect(_: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(elsewhere.url + "/collective_rpc")

    hop = stub({("POST", "/collective_rpc"): redirect})
    with pytest.raises(EngineError, match="answered HTTP 307, a redirect") as e:
        VllmDriver(hop.url, KEY).sync()
    assert (e.value.status, elsewhere.requests) == (307, [])  # the key went nowhere else


@pytest.mark.parametrize(("results", "wrong"), [
    ([{"rank": 0}, {"rank": 0}], "ranks [0, 0], not 0..1 once each"),
    ([{"rank": 1}], "ranks [1], not 0..0"),
    ([{"rank": 0, "extra": 1}], "extra: Extra inputs are not permitted"),
    ([{"rank": "0"}], "rank: Input should be a valid integer"),
    ([{"rank": 0, "k" * 5000: 1}], "is not a RankAnswer (kkk"),  # a peer's key, cut short
    ({"rank": 0}, "without a results list"),
    ([], "not one answer per rank"),
])
def test_answers_that_break_the_contract_are_refused(
        stub: Callable[[Routes], Stub], results: Any, wrong: str) -> None:
    server = stub({("POST", "/collective_rpc"): answer(
        {"results": results} if isinstance(results, list) else results)})
    with pytest.raises(BadAnswer, match=re.escape(wrong)) as e:
        VllmDriver(server.url).sync()
    assert len(str(e.value)) < 400
    with pytest.raises(BadAnswer):
        VllmDriver(server.url).fingerprint()


def test_a_restarted_or_absent_engine_reads_as_unreachable_and_bad_urls_are_refused(
        stub: Callable[[Routes], Stub]) -> None:
    server = stub({("GET", "/health"): answer(None, 503)})
    engine = VllmDriver(server.url)
    assert not engine.health()
    server.close()
    with pytest.raises(EngineError, match=r"instance \(POST /collective_rpc\): no answer") as e:
        engine.instance()
    assert e.value.status is None
    assert not engine.health()
    for url in ("file:///etc/passwd", "ftp://h/x", "http://"):
        with pytest.raises(ConfigError, match="HTTP"):
            VllmDriver(url)
    with pytest.raises(ConfigError, match="printable ASCII"):
        VllmDriver("http://127.0.0.1:1", "two words")
    with pytest.raises(ConfigError, match="plain file name"):
        engine.apply(["../escape.dcrp"])
    with pytest.raises(ConfigError, match="relative path"):
        engine.load_dense("/abs/v1")


# --- SGLang -----------------------------------------------------------------------------


class AllowListUnpickler(pickle.Unpickler):
    """SGLang's rule: only allow-listed globals (here, exactly what DCR's entry uses)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"blocked {module}.{name}")
        return super().find_class(module, name)


def test_the_call_entry_unpickles_with_only_allow_listed_globals_into_an_empty_tensor() -> None:
    name = 'dcr:{"call":"00","method":"dcr_sync","args":[]}'
    ((got, tensor),) = AllowListUnpickler(io.BytesIO(call_pickle(name))).load()
    assert got == name
    assert isinstance(tensor, torch.Tensor)
    assert (tensor.dtype, tuple(tensor.shape)) == (torch.uint8, (0,))
    assert tensor.to("cpu").numel() == 0  # what SGLang does to each tensor before the loader


def sglang_routes(staging: Path, state: dict[str, Any]) -> Routes:
    """SGLang 0.5.23 as the adapter uses it, with DCR's loader registered."""
    def ok(message: str = "Success") -> web.Response:
        return web.json_response({"success": True, "message": message})

    def failed(message: str) -> web.Response:
        return web.json_response({"success": False, "message": message}, status=400)

    async def begin(_: web.Request) -> web.Response:
        if state.get("session"):
            return failed("a weight-update session is already open")
        state["session"] = True
        return ok()

    async def end(_: web.Request) -> web.Response:
        if not state.pop("session", False):
            return failed("no weight-update session is open")
        return ok()

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        if not state.get("session"):
            return failed("update_weights_from_tensor must run between begin_weight_update() "
                          "and end_weight_update()")
        if body.get("load_format") != LOADER:
            raise NotImplementedError(body.get("load_format"))
        entries = body["serialized_named_tensors"]
        assert len(entries) == WORLD
        for rank, entry in enumerate(entries):  # each TP rank runs the custom loader
            ((name, _),) = AllowListUnpickler(io.BytesIO(base64.b64decode(entry))).load()
            call = json.loads(name.removeprefix("dcr:"))
            reply = state.get("fail") or plugin_answer(call["method"], call["args"], rank)
            path = staging / result_name(call["call"], rank)
            if "plant" in state:  # a link where the answer should be
                path.symlink_to(state["plant"])
            else:
                path.write_text(json.dumps(reply))
        return ok()

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"tp_size": WORLD, "dp_size": 1})

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": state.get("label", "default")})

    async def version(request: web.Request) -> web.Response:
        state["label"] = (await request.json())["new_version"]
        return ok()

    return {("POST", "/begin_weight_update"): begin, ("POST", "/end_weight_update"): end,
            ("POST", "/update_weights_from_tensor"): update,
            ("GET", "/server_info"): server_info, ("GET", "/model_info"): model_info,
            ("POST", "/update_weight_version"): version,
            ("POST", "/pause_generation"): answer({"message": "paused", "status": "ok"}),
            ("POST", "/continue_generation"): answer({"message": "continued", "status": "ok"}),
            ("GET", "/health"): answer(None)}


def test_sglang_engine_carries_plugin_calls_through_the_custom_loader_and_staged_answers(
        stub: Callable[[Routes], Stub], tmp_path: Path) -> None:
    state: dict[str, Any] = {}
    server = stub(sglang_routes(tmp_path, state))
    engine = SglangDriver(server.url, tmp_path, KEY)

    assert engine.instance() == "00" * 8 + "-" + "01" * 8
    assert engine.prewarm(TENSORS).profile.tensors == {"a.weight": "xor", "b.weight": "overwrite"}
    outcome = engine.apply(["p-0.dcrp"])
    assert outcome.names == {"a.weight"}
    assert outcome.reports[0]["writes"] == 3  # the report's other fields, as sent
    assert engine.fingerprint()[1] == {"a.weight": "xxh3-128:1"}
    engine.pause("keep")
    engine.load_dense("v2")
    engine.set_version("2")
    assert engine.version() == "2"
    engine.resume()
    engine.sync()
    assert engine.health()
    assert list(tmp_path.iterdir()) == []  # every answer read and removed

    calls = server.calls()
    assert calls[0] == ("GET", "/server_info", None)  # tp_size, once
    updates = [b for _, p, b in calls if p == "/update_weights_from_tensor"]
    assert [(u["load_format"], u["flush_cache"], u["abort_all_requests"]) for u in updates] == [
        (LOADER, False, False),  # instance
        (LOADER, False, False),  # prewarm
        (LOADER, True, False),  # apply: the prefix cache is stale
        (LOADER, False, False),  # fingerprint
        (LOADER, False, False),  # load_dense while requests are parked in place
        (LOADER, False, False),  # sync
    ]
    sessions = [p for _, p, _ in calls if "weight_update" in p or p.endswith("_tensor")]
    assert sessions == ["/begin_weight_update", "/update_weights_from_tensor",
                        "/end_weight_update"] * 6
    assert [(p, b) for _, p, b in calls if p in ("/pause_generation", "/continue_generation",
                                                 "/update_weight_version")] == [
        ("/pause_generation", {"mode": "in_place"}),
        ("/update_weight_version", {"new_version": "2", "abort_all_requests": False}),
        ("/continue_generation", {})]


def test_sglang_engine_refuses_wait_and_reports_a_ranks_failure_by_rank(
        stub: Callable[[Routes], Stub], tmp_path: Path) -> None:
    state: dict[str, Any] = {}
    server = stub(sglang_routes(tmp_path, state))
    engine = SglangDriver(server.url, tmp_path, KEY, tp_size=WORLD)
    with pytest.raises(EngineError, match="cannot let requests in flight finish"):
        engine.pause("wait")
    assert server.requests == []  # refused before anything was sent
    engine.pause("abort")
    assert server.calls()[-1] == ("POST", "/pause_generation", {"mode": "abort"})

    state["fail"] = {"rank": 0, "error": "Staged payload 'p.dcrp' cannot be opened\x07"}
    with pytest.raises(EngineError, match="apply failed on rank 0: Staged payload 'p.dcrp' "
                                          r"cannot be opened\?$"):
        engine.apply(["p.dcrp"])
    assert list(tmp_path.iterdir()) == []
    assert not state.get("session")  # the session was closed after the failure

    secret = tmp_path.parent / "secret.json"
    secret.write_text(json.dumps({"rank": 0, "error": "the contents of another file"}))
    state.pop("fail")
    state["plant"] = secret
    with pytest.raises(BadAnswer, match="rank 0 left no readable answer") as e:
        engine.sync()
    assert "contents" not in str(e.value)  # a planted link is not followed
    assert list(tmp_path.iterdir()) == []
    del state["plant"]

    state["session"] = True  # SGLang refuses a second session: the error names it
    with pytest.raises(EngineError, match="a weight-update session is already open"):
        engine.sync()
