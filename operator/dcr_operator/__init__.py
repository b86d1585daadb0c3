"""The DCR control plane (kopf operator for WeightRefit and RolloutFleet).

Not built yet: the operator arrives with its own issue. This package exists so the
distribution's layout and the import contracts (no torch here) are in place from the start.
"""
