"""The operator's API types: one module per kind, as the CRDs serve them.

* :mod:`.rolloutfleet`: RolloutFleet (a set of rollout pods refit together).
* :mod:`.weightrefit`: WeightRefit (one transition of one fleet to a target version).
* :mod:`.common`: the group and version, model bases, object names, conditions.
* :mod:`.conditions`: condition types and reasons, one documented constant each.
* :mod:`.volumes`: the volumes an encoder profile mounts.
* :mod:`.schema`, :mod:`.generate`: the CRDs generated from the models
  (``python -m dcr_operator.api.generate``).
"""
