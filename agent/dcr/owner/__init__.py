"""The training side of the wire: owners that diff a candidate against the committed baseline.

* ``state``: the baseline/candidate state and its rules, shared by every owner form.
* ``encoder``: :class:`Encoder`, the in-process owner a trainer calls.
* ``process``: :class:`ProcessOwner`, its per-attempt process form (``dcr encode``).
* ``warm``: :class:`WarmOwner`, an ``Encoder`` over memory-mapped checkpoint directories
  opened by version, the main job's default owner form.
* ``shards``: :class:`ShardEncoder`, a trainer rank that projects its TP/EP shards straight
  into canonical coordinates.
* ``diff``: the engine that diffs canonical tensors bucket by bucket.
* ``writer``: seals buckets, puts payloads and writes the manifest, for ``diff`` and
  ``shards`` alike.
* ``settings``: :class:`EncodeSettings`, the one declaration of how an owner encodes, from
  which the ``dcr diff``/``dcr encode`` options and encoder command lines are built
  (torch-free: the operator imports it).
"""
