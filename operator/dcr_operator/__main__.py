"""``python -m dcr_operator``: run the operator (what the Helm chart's Deployment runs).

``--namespace`` (repeatable) watches only those namespaces; ``--standalone`` skips peering
(docs/operations.md, "One operator at a time").
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr_operator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--namespace", action="append", default=[],
                   help="namespace to watch (repeatable; default: all namespaces)")
    p.add_argument("--standalone", action="store_true", help="no peering (one replica)")
    p.add_argument("--peering", default="dcr-operator", help="peering resource name")
    p.add_argument("--priority", type=int, default=0,
                   help="peering priority: the highest-priority operator works")
    p.add_argument("--liveness", metavar="URL",
                   help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import kopf

    import dcr_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority,
        namespaces=args.namespace,
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
