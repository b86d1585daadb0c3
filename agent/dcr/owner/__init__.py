"""The training side of the wire: owners that diff a candidate against the committed baseline.

``state`` holds the rules every owner form obeys; the forms are ``encoder`` (in process),
``process`` (``dcr encode`` per attempt), ``warm`` (checkpoints by version) and ``shards`` (a
trainer rank's shards); ``diff`` and ``writer`` find and write the changes; ``settings`` is
the torch-free declaration of how an owner encodes; ``server`` is ``dcr encoder``.
"""
