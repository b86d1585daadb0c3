"""Pydantic's JSON schema, rewritten as the structural OpenAPI v3.0 schema a CRD needs.

The API server accepts only structural schemas (every node typed, no ``$ref``, no
``additionalProperties: false``). :func:`structural` inlines ``$ref`` (siblings overlaid),
turns ``anyOf: [X, null]`` into ``X``, ``additionalProperties: true`` into
``x-kubernetes-preserve-unknown-fields``, ``const`` into ``enum`` and ``exclusiveMinimum: n``
into v3.0's boolean form; it drops ``title`` and ``additionalProperties: false`` (the API
server prunes unknown fields), and ``default`` unless ``defaults``. ``x-kubernetes-*``
extensions from ``json_schema_extra`` pass as written.
"""

from __future__ import annotations

from typing import Any

_DROP = frozenset({"title", "$defs"})


def structural(schema: dict[str, Any], *, defaults: bool = True) -> dict[str, Any]:
    """The structural form of a pydantic model's ``model_json_schema()``."""
    return _node(schema, schema.get("$defs", {}), defaults)


def _resolve(ref: str, defs: dict[str, Any]) -> dict[str, Any]:
    prefix = "#/$defs/"
    if not ref.startswith(prefix):
        raise ValueError(f"Unsupported $ref {ref!r}: only local $defs are inlined.")
    found: dict[str, Any] = defs[ref[len(prefix):]]
    return found


def _node(node: dict[str, Any], defs: dict[str, Any], defaults: bool) -> dict[str, Any]:
    if "$ref" in node:
        merged = {**_resolve(node["$ref"], defs),
                  **{k: v for k, v in node.items() if k != "$ref"}}
        return _node(merged, defs, defaults)
    any_of = node.get("anyOf")
    if any_of is not None:
        rest = [s for s in any_of if s != {"type": "null"}]
        if len(rest) < len(any_of) and len(rest) == 1:
            merged = {**rest[0], **{k: v for k, v in node.items() if k != "anyOf"}}
            return _node(merged, defs, defaults)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or (key == "default" and not defaults):
            continue
        if key == "default" and value is None:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "properties":
            out[key] = {name: _node(sub, defs, defaults) for name, sub in value.items()}
        elif key == "items":
            out[key] = _node(value, defs, defaults)
        elif key == "anyOf":
            out[key] = [_node(sub, defs, defaults) for sub in value]
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out[key] = _node(value, defs, defaults)
        else:
            out[key] = value
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)  # int-or-string nodes are typed by the extension alone
    if "enum" in out and "type" not in out:
        out["type"] = _type_of(out["enum"])
    if "properties" in out and "type" not in out:
        out["type"] = "object"
    return out


def _type_of(values: list[Any]) -> str:
    kinds = {type(v) for v in values}
    if kinds <= {str}:
        return "string"
    if kinds <= {int}:
        return "integer"
    raise ValueError(f"Enum {values!r} mixes types; a structural schema needs one.")


def check_structural(node: dict[str, Any], path: str = "") -> list[str]:
    """Problems that would make the API server refuse the schema (empty when none)."""
    problems: list[str] = []
    if "$ref" in node or "$defs" in node:
        problems.append(f"{path or '/'}: $ref or $defs left in")
    if "type" not in node and not (node.get("x-kubernetes-int-or-string")
                                   or node.get("x-kubernetes-preserve-unknown-fields")):
        problems.append(f"{path or '/'}: no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path or '/'}: both properties and additionalProperties")
    for name, sub in node.get("properties", {}).items():
        problems += check_structural(sub, f"{path}/{name}")
    if "items" in node:
        problems += check_structural(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        problems += check_structural(node["additionalProperties"], f"{path}/*")
    return problems
