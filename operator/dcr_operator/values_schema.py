"""The operator settings' part of the Helm chart's values schema, generated from their
declarations in :mod:`dcr_operator.settings`.

``python -m dcr_operator.values_schema`` (``make values-schema``) rewrites each Helm value
that sets an :class:`~dcr_operator.settings.OperatorSettings` field in
``charts/dcr/values.schema.json``: its type from the field's, its bounds and choices as the
field declares them, and its description from the field's doc and variable. The rest of the
schema is written as it stands; a test keeps the checked-in file equal to :func:`render`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from dcr_operator.api.generate import REPO_ROOT
from dcr_operator.settings import OperatorSettings, declared, env_name

SCHEMA_PATH = REPO_ROOT / "charts" / "dcr" / "values.schema.json"
ENTRY_POINT = "python -m dcr_operator.values_schema"

# JSON-schema type of each field type (annotations are strings under `from __future__`).
JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
_WIDTH = 96  # a node that fits on a line of this many characters is written on one


def setting_schemas() -> dict[str, dict[str, Any]]:
    """The schema of every Helm value that sets a field, by its dotted path."""
    out = {}
    for f in fields(OperatorSettings):
        rules = declared(f)
        node: dict[str, Any] = {"type": JSON_TYPES[str(f.type)], **rules.bounds}
        if rules.choices:
            node["enum"] = list(rules.choices)
        node.update(rules.chart)
        node["description"] = f"{f.metadata['doc']} Sets {env_name(f)}."
        out[rules.value] = node
    return out


def with_settings(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (the values schema) with each setting's node replaced by its generated one."""
    for path, node in setting_schemas().items():
        *parents, leaf = path.split(".")
        at = schema
        for name in parents:
            at = at["properties"][name]
        at["properties"][leaf] = node
    return schema


def _dump(node: Any, indent: int, lead: int = 0) -> str:
    """``node`` as JSON, an object over lines only where it would not fit on one (after
    ``lead`` characters of the line it starts on)."""
    flat = json.dumps(node, ensure_ascii=False)
    if not isinstance(node, dict) or not node or lead + len(flat) < _WIDTH:
        return flat
    pad = " " * (indent + 2)
    items = [f"{pad}{json.dumps(k)}: {_dump(v, indent + 2, len(pad) + len(json.dumps(k)) + 2)}"
             for k, v in node.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def render(text: str) -> str:
    """The values schema ``text`` with the settings' nodes generated, as it is checked in."""
    return _dump(with_settings(json.loads(text)), 0) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=ENTRY_POINT, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the checked-in schema differs")
    p.add_argument("--path", type=Path, default=SCHEMA_PATH, help="the values schema")
    args = p.parse_args(argv)
    text = args.path.read_text()
    if render(text) == text:
        return 0
    if args.check:
        print(f"stale {args.path}: run `{ENTRY_POINT}`")
        return 1
    args.path.write_text(render(text))
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
