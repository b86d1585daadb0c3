"""The relay tree: owners stream payloads to one root, which forwards them down a tree.

One concern per module: ``tree``, ``settings``, ``wire``, ``staging``, ``client``,
``publish``, ``source`` and ``node`` (``dcr relay``). docs/relay.md argues the design.
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
