"""Glue between DCR and training frameworks, each behind its own extra (``dcr[trl]``)."""
