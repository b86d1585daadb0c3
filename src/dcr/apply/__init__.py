"""In-place apply through the serving runtime's own loader (DESIGN section 5)."""
