"""The HTTP edges every DCR server and client shares: bearer tokens (``tokens``), the direct
opener for calls that carry a credential (``direct``), the servers' guard, error statuses and
start (``edge``), the clients' door to the engine (``gateway``) and Prometheus text
(``prometheus``). Torch-free, at the bottom layer.
"""
