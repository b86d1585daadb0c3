"""What the cluster tests (tests/operator's end to end, tests/deploy) share."""

from __future__ import annotations

from dcr.refit.trainer import TrainerSettings

# Smaller than the main job's model and a faster learning rate, no warm-up: a cluster
# test wants quick steps with enough changes per version.
CLUSTER_TRAINER = TrainerSettings(hidden_size=128, intermediate_size=344, layers=2, heads=4,
                                  kv_heads=2, seq=64, batch=4, lr=1e-5, warmup_steps=0,
                                  corpus=("json", "shutil"), max_shard_size="200KB")
