"""DCR: Delta-Compressed Refit.

Ships only the changed bits of a policy from training to rollout, addressed in Hugging Face
canonical coordinates (docs/architecture.md).
"""

__version__ = "0.1.0"
