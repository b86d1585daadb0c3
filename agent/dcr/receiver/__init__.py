"""The rollout-side agent: one per pod, between the protocol and the serving engine.

Torch-free: the model is the engine's (docs/protocol.md, docs/engines.md).
"""
