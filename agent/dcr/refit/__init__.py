"""The main job, ``dcr refit`` (docs/architecture.md, "The main job").

Nothing here is imported by the layers below it (import-linter).
"""
