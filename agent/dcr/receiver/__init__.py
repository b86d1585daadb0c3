"""The rollout-side agent: one per pod, between the protocol and the serving engine.

``service`` holds the protocol logic (staging, ordered apply, gate, journal) and drives
the engine through :class:`~dcr.drivers.base.Driver`; ``staging`` is the directory it
shares with the engine; ``server`` puts the service behind the HTTP control API
(:mod:`dcr.protocol.agent_api`); ``main`` builds a process; ``launch`` starts processes
(agents and the reference servers beside them) for the main job, tests and benchmarks.
Torch-free: the model is the engine's.
"""
