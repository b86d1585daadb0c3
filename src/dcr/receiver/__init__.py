"""The rollout-side agent: one per rank, between the protocol and the serving runtime.

``service`` holds the protocol logic (staging, ordered apply, gate, journal);
``server`` puts it behind the HTTP control API (:mod:`dcr.protocol.agent_api`);
``host`` wraps a serving runtime with its apply engine; ``main`` builds a process.
"""
