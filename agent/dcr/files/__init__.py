"""File-level refit: diff two checkpoints into a store, patch a checkpoint from it."""
