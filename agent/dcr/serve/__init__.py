"""``dcr serve``: the reference serving engine, a separate process in vLLM's dialect.

It holds the model and serves the endpoints of vLLM's server that the agent uses, so the
sidecar code tested on CPU is the code that drives vLLM (docs/engines.md, "The reference
engine: ``dcr serve``").
"""
