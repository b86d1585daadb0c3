"""The operator's API types: one module per kind, as the CRDs serve them, and the CRDs
generated from them (``python -m dcr_operator.api.generate``).
"""
