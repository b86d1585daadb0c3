"""In-place apply through the serving runtime's own loader (docs/apply.md)."""
