"""Pydantic's JSON schema rewritten into a Kubernetes structural schema: references
inlined, optional fields un-nulled, free-form maps marked. Defaults are left out on
purpose: the API server would persist them into the user's object and a stage override
would then override every default field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

Schema = dict[str, Any]

_DROP = {"title", "default"}


def _structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    """Rewrite one pydantic JSON-schema node into a structural OpenAPI v3 node."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        merged = {**target, **node}
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        types = {o.get("type") for o in options}
        if types == {"string", "integer"}:
            # Quantities, written the way controller-gen writes resource.Quantity.
            pattern = next(o.get("pattern") for o in options if o.get("type") == "string")
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            node["x-kubernetes-int-or-string"] = True
            if pattern:
                node["pattern"] = pattern
            return {k: v for k, v in node.items() if k not in _DROP}
        elif len(options) == 1:
            node = {**options[0], **node}
        else:
            raise ValueError(f"cannot express union in a structural schema: {options}")
        return _structural(node, defs)
    out: Schema = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        elif key == "additionalProperties":
            if value is True or value == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif value is not False:
                out[key] = _structural(value, defs)
        elif key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            # JSON Schema's number form; OpenAPI v3 (and the API server) want a bool.
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "description":
            out[key] = " ".join(value.split())
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if (
        out.get("type") == "object"
        and "properties" not in out
        and "additionalProperties" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def model_schema(model: type[BaseModel]) -> Schema:
    """The model's validation schema, by its wire names, as a structural schema."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def _walk(node: Schema, path: str, visit: Any) -> None:
    visit(node, path)
    for name, child in node.get("properties", {}).items():
        _walk(child, f"{path}.{name}", visit)
    if "items" in node:
        _walk(node["items"], f"{path}[]", visit)
    if isinstance(node.get("additionalProperties"), dict):
        _walk(node["additionalProperties"], f"{path}{{}}", visit)


def require_descriptions(schema: Schema, root: str) -> None:
    """Refuse a schema with a field that has no description: `kubectl explain` shows it."""
    missing: list[str] = []

    def visit(node: Schema, path: str) -> None:
        if not node.get("description") and not path.endswith(("[]", "}")):
            missing.append(path)

    _walk(schema, root, visit)
    if missing:
        raise ValueError(f"fields without a description: {', '.join(missing)}")
