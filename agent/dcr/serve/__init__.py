"""``dcr serve``: the reference serving engine, a separate process in vLLM's dialect.

The agent drives a serving engine only through the engine's HTTP API
(:mod:`dcr.drivers`). For tests and the demo, this package is that engine: it holds a
model (``hf``, or every rank of ``vllm-ref``), gives each rank a worker carrying DCR's
plugin (the same worker extension a vLLM server is started with), and serves the
endpoints of vLLM's server that the agent uses: ``/collective_rpc``, ``/pause``,
``/resume``, ``/is_paused``, the weight-version routes, ``/health`` and
``/v1/completions``. So the sidecar code that runs on CPU in CI is the code that drives
vLLM in production; only the server differs.

``settings`` declares the options; ``workers`` builds a worker per rank and calls the
plugin; ``gate`` is vLLM's pause modes; ``completions`` the greedy endpoint; ``server``
the aiohttp app; ``main`` the process; ``local`` the same workers as an in-process
engine for tests and benchmarks (no HTTP).
"""
