"""The training side of the wire: owners that diff a candidate against the committed baseline.

``encoder`` is the in-process owner a trainer calls and ``ProcessOwner`` its per-attempt
process form (``dcr encode``); ``shards`` projects a trainer rank's TP/EP shards straight
into canonical coordinates; ``diff`` is the engine that diffs canonical tensors bucket by
bucket and writes payloads and the manifest.
"""
