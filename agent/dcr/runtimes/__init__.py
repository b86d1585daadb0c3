"""Serving runtimes DCR applies refits through, and stand-ins for the ones it cannot install."""
