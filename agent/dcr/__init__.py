"""DCR: Delta-Compressed Refit.

Ships only the changed bits of a policy from training to rollout: XOR masks where the
receiver's storage keeps the checkpoint's bits, absolute overwrites elsewhere, addressed
in Hugging Face canonical coordinates (tensor name plus flat element index).
"""

__version__ = "0.1.0"
