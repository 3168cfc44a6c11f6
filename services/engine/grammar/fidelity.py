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


def _multiple_of_loosened(node: dict[str, Any]) -> bool:
    value = node.get("multipleOf")
    if value is None:
        return False
    return not isinstance(value, int) or isinstance(value, bool) or value > 1024


def _local_findings(node: dict[str, Any], path: str) -> list[str]:
    found = [f"{path}/{k}: not enforced" for k in _IGNORED if k in node]
    if _multiple_of_loosened(node):
        found.append(f"{path}/multipleOf: only integers up to 1024 are enforced")
    if any(k in node for k in _LENGTH) and any(k in node for k in _PATTERNED):
        found.append(f"{path}/minLength,maxLength: not enforced together with pattern/format")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"{path}/$ref: remote references are not resolved")
    if "oneOf" in node:
        found.append(f"{path}/oneOf: enforced as anyOf (exclusivity not checked)")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        found.append(f"{path}/allOf: several branches are merged loosely")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _inner_anchor(pattern):
        found.append(f"{path}/pattern: anchors inside the pattern are ignored")
    return found


def _inner_anchor(pattern: str) -> bool:
    """`^` or `$` anywhere but the two ends (e.g. `^a$|^b$`): xgrammar drops such anchors."""
    inner = pattern[1:] if pattern.startswith("^") else pattern
    inner = inner[:-1] if inner.endswith("$") and not inner.endswith("\\$") else inner
    unescaped = inner.replace("\\\\", "").replace("\\^", "").replace("\\$", "")
    unescaped = re.sub(r"\[[^\]]*\]", "", unescaped)  # anchors inside [...] are literals
    return "^" in unescaped or "$" in unescaped


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
