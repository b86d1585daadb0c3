"""The HTTP edges every DCR server and client shares: bearer tokens (``tokens``), the direct
opener for calls that carry a credential (``direct``) and Prometheus text (``prometheus``).
Stdlib-only and torch-free, at the bottom layer.
"""
