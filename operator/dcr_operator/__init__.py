"""The DCR control plane: a kopf operator for RolloutFleet and WeightRefit.

It is the refit coordinator: :class:`dcr.protocol.coordinator.Coordinator` over the fleet's
agents, encoder Jobs or warm encoders, and a commit record on the fleet's status. It never
imports torch (an import-linter contract). docs/operator.md argues the design.
"""
