"""The main job, ``dcr refit`` (``make demo``): a trainer, rollout pods as real processes, the
boundary between them, kills mid-refit and a full-checkpoint refit timed beside each step.

``job`` drives it; ``trainer`` trains and exports; ``launch`` starts the agents, servers and
encoders as processes; ``boundary`` and ``linkemu`` emulate the link between the clusters;
``full`` times the full-checkpoint refit; ``kills`` lands kills inside attempts; ``plot``
draws the result. Nothing here is imported by the layers below it (import-linter).
"""
