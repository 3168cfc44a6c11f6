"""Which JSON Schema keywords the grammar backend would loosen or ignore, with their JSON paths.

xgrammar 0.2.9 compiles these without enforcing them (see the design notes): a caller who relies on
them must be told, and refused when it asks for strict fidelity.
"""

from __future__ import annotations

import re
from typing import Any

_IGNORED = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    # seen decoding maskbench: outputs that ignored these validated false
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
)
_LENGTH = ("minLength", "maxLength")
_PATTERNED = ("pattern", "format")
_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_CHILD_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_CHILD_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "not")


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _multiple_of_loosened(node: dict[str, Any]) -> str:
    """Why xgrammar drops the node's `multipleOf` ('' when it enforces it)."""
    value = node.get("multipleOf")
    if value is None:
        return ""
    if not isinstance(value, int) or isinstance(value, bool) or value > 1024:
        return "only integers up to 1024 are enforced"
    # xgrammar warns "range + multipleOf combination not yet supported" on stderr and drops
    # it; `bound_numbers` gives every integer a range, so this is the default case
    if any(k in node for k in _BOUNDS):
        return "not enforced beside a range (minimum/maximum, or bound_numbers)"
    return ""


def _local_findings(node: dict[str, Any], path: str) -> list[str]:
    found = [f"{path}/{k}: not enforced" for k in _IGNORED if k in node]
    multiple_of = _multiple_of_loosened(node)
    if multiple_of:
        found.append(f"{path}/multipleOf: {multiple_of}")
    if any(k in node for k in _LENGTH) and any(k in node for k in _PATTERNED):
        found.append(f"{path}/minLength,maxLength: not enforced together with pattern/format")
    if "oneOf" in node:
        found.append(f"{path}/oneOf: enforced as anyOf (exclusivity not checked)")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        found.append(f"{path}/allOf: several branches are merged loosely")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _inner_anchor(pattern):
        found.append(f"{path}/pattern: anchors inside the pattern are ignored")
    found += _untyped_branches(node, path)
    found += _undeclared_required(node, path)
    found += _values_against_type(node, path)
    return found


# A branch carrying one of these keywords describes a value; one without (e.g. `{"required": [..]}`)
# is compiled as "any JSON value", which makes the whole anyOf/oneOf accept anything.
_SHAPING = ("type", "properties", "items", "prefixItems", "$ref", "enum", "const", "anyOf", "oneOf")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "array": (list,),
    "object": (dict,),
}


def _untyped_branches(node: dict[str, Any], path: str) -> list[str]:
    found = []
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if not isinstance(branches, list):
            continue
        for i, branch in enumerate(branches):
            if isinstance(branch, dict) and branch and not any(k in branch for k in _SHAPING):
                found.append(f"{path}/{key}/{i}: a branch without a type accepts any value")
    return found


def _undeclared_required(node: dict[str, Any], path: str) -> list[str]:
    required = node.get("required")
    props = node.get("properties")
    if not isinstance(required, list) or not isinstance(props, dict):
        return []
    missing = [name for name in required if isinstance(name, str) and name not in props]
    if not missing:
        return []
    return [f"{path}/required: {', '.join(missing)} not in properties, so not enforced"]


def _matches_type(value: Any, type_name: str) -> bool:
    kinds = _JSON_TYPES.get(type_name)
    if kinds is None:
        return True
    if isinstance(value, bool) and type_name in ("integer", "number"):
        return False
    return isinstance(value, kinds)


def _values_against_type(node: dict[str, Any], path: str) -> list[str]:
    """`{"type": "object", "enum": ["A"]}`: the grammar follows the values, jsonschema both."""
    declared = node.get("type")
    types = [declared] if isinstance(declared, str) else declared
    if not isinstance(types, list):
        return []
    values = node["enum"] if isinstance(node.get("enum"), list) else []
    if "const" in node:
        values = [*values, node["const"]]
    if any(not any(_matches_type(v, t) for t in types) for v in values):
        return [f"{path}/type: contradicts enum/const values; the values are used"]
    return []


def _inner_anchor(pattern: str) -> bool:
    """`^` or `$` anywhere but the two ends (e.g. `^a$|^b$`): xgrammar drops such anchors."""
    inner = pattern[1:] if pattern.startswith("^") else pattern
    inner = inner[:-1] if inner.endswith("$") and not inner.endswith("\\$") else inner
    unescaped = inner.replace("\\\\", "").replace("\\^", "").replace("\\$", "")
    unescaped = re.sub(r"\[[^\]]*\]", "", unescaped)  # anchors inside [...] are literals
    return "^" in unescaped or "$" in unescaped


VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # data, not schemas


def remote_refs(node: Any, path: str = "#") -> list[str]:
    """Each `$ref` that is not within the document (`#...`), as `PATH/$ref: URI`. No backend
    resolves one, and nothing of ours fetches one: a tenant's URI is no address for us to call."""
    if isinstance(node, list):
        return [f for i, child in enumerate(node) for f in remote_refs(child, f"{path}/{i}")]
    if not isinstance(node, dict):
        return []
    ref = node.get("$ref")
    found = []
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"{path}/$ref: {ref[:200]}")
    for key, child in node.items():
        if key not in VALUE_KEYWORDS:
            found += remote_refs(child, f"{path}/{key}")
    return found


def loosened_keywords(schema: Any, path: str = "#") -> list[str]:
    """Findings like `#/properties/tags/uniqueItems: not enforced`; empty when fully enforced."""
    if not isinstance(schema, dict):
        return []
    found = _local_findings(schema, path)
    for key in _CHILD_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                found += loosened_keywords(child, f"{path}/{key}/{name}")
    for key in _CHILD_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                found += loosened_keywords(child, f"{path}/{key}/{i}")
    for key in _CHILD_ONE:
        if key in schema and key != "not":
            found += loosened_keywords(schema[key], f"{path}/{key}")
    return found


def loosened_in_tag(node: Any, path: str = "#") -> list[str]:
    """The findings of every JSON schema inside a structural tag (tool arguments, ...), with
    the path of each schema in the tag."""
    if isinstance(node, list):
        return [w for i, child in enumerate(node) for w in loosened_in_tag(child, f"{path}/{i}")]
    if not isinstance(node, dict):
        return []
    if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
        return loosened_keywords(node["json_schema"], f"{path}/json_schema")
    return [w for k, v in node.items() for w in loosened_in_tag(v, f"{path}/{k}")]
