"""The relay tree: owners stream payloads to one root, which forwards them down a tree.

Each payload crosses the cluster boundary once (owner -> root); every further copy
travels over local links inside the rollout cluster. One concern per module: the tree
math (:mod:`.tree`), a node's settings (:mod:`.settings`), what members say to each
other (:mod:`.wire`), the bounded staging area (:mod:`.staging`), the client
(:mod:`.client`), publishing (:mod:`.publish`), the receivers' source (:mod:`.source`),
and the node, an HTTP server behind ``dcr relay`` (:mod:`.node`). Errors are
:class:`dcr.errors.RelayError` and :class:`dcr.errors.RelayNotFound`.

docs/relay.md argues the design (cut-through forwarding, verification at every hop, the
two credentials, the staging budget, re-attachment) and lists the endpoints.
"""

from dcr.errors import RelayError, RelayNotFound
from dcr.transport.relay.client import RelayClient, StagedPayload
from dcr.transport.relay.node import RelayNode, run_relay, serve
from dcr.transport.relay.settings import RelaySettings
from dcr.transport.relay.source import RelaySource
from dcr.transport.relay.staging import Staging
from dcr.transport.relay.tree import (
    ancestors_of,
    children_of,
    depth_of,
    parent_of,
    parse_address,
    tree_depth,
)
from dcr.transport.relay.wire import Key

__all__ = [
    "Key",
    "RelayClient",
    "RelayError",
    "RelayNode",
    "RelayNotFound",
    "RelaySettings",
    "RelaySource",
    "StagedPayload",
    "Staging",
    "ancestors_of",
    "children_of",
    "depth_of",
    "parent_of",
    "parse_address",
    "run_relay",
    "serve",
    "tree_depth",
]
