"""The relay tree's shape: who is whose parent among ``members`` in order, and addresses.

Every node derives the same tree from the same list (docs/relay.md, "Choices, and why").
"""

from __future__ import annotations

from dcr.http.edge import host_port


def parent_of(index: int, fanout: int) -> int | None:
    """The parent of member ``index`` in the balanced ``fanout``-ary tree; None for root."""
    return None if index == 0 else (index - 1) // fanout


def children_of(index: int, fanout: int, size: int) -> range:
    """Members ``fanout*index+1 .. fanout*index+fanout`` that exist among ``size``."""
    first = fanout * index + 1
    return range(min(first, size), min(first + fanout, size))


def ancestors_of(index: int, fanout: int) -> list[int]:
    """Parent, grandparent, ... up to the root, nearest first."""
    out: list[int] = []
    p = parent_of(index, fanout)
    while p is not None:
        out.append(p)
        p = parent_of(p, fanout)
    return out


def depth_of(index: int, fanout: int) -> int:
    """Hops from the root to member ``index``."""
    return len(ancestors_of(index, fanout))


def tree_depth(size: int, fanout: int) -> int:
    """Hops from the root to the deepest of ``size`` members."""
    return depth_of(size - 1, fanout) if size else 0


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, a host required; ConfigError names the value
    otherwise."""
    return host_port(text, "Relay address", default_host=None)
