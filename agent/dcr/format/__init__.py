"""The wire formats: dtypes, the payload container, and the per-attempt manifest."""
