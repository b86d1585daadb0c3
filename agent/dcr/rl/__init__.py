"""The RL main job (``make demo-rl``): GRPO through :mod:`dcr.integrations.trl`."""
