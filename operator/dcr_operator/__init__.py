"""The DCR control plane: a kopf operator for RolloutFleet and WeightRefit.

The operator is the refit coordinator (docs/operations.md, docs/architecture.md). It
validates a WeightRefit, launches the encoder Job that publishes each attempt, drives
the fleet's agents through their HTTP API with
:class:`dcr.protocol.coordinator.Coordinator`, and performs the joint commit as a
compare-and-set on the RolloutFleet's status. It never imports torch: only the
torch-free ``dcr.protocol``, ``dcr.format`` and ``dcr.owner.settings`` modules (an
import-linter contract in pyproject.toml keeps it so).

Modules, one concern each:

* :mod:`.crds`: the CRDs' pydantic models (the one source of truth) and their generator;
  :mod:`.schema` turns pydantic's JSON schema into a structural OpenAPI schema.
* :mod:`.kube`: the coordinator thread's blocking Kubernetes API client, on the ``kubernetes``
  package (its config loaders and ApiClient).
* :mod:`.commitstore`: the commit record in the fleet's status, as a ``CommitStore``.
* :mod:`.reconcile`: pure functions: validation, conditions, phase, receivers, status.
* :mod:`.jobs`: encoder Job manifests and the owner handle that waits for them.
* :mod:`.volumes`: the volumes an encoder profile mounts (checkpoints) and their checks.
* :mod:`.refit`: one refit: the coordinator in a thread, recording progress.
* :mod:`.cleanup`: what the WeightRefit finalizer deletes from the object store.
* :mod:`.settings`: the operator's settings, parsed once from its environment.
* :mod:`.handlers`: the kopf handlers; ``python -m dcr_operator`` runs them.
"""
