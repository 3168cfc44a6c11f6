"""Common shapes of `not` and `oneOf`, said again in keywords the grammars enforce.

No backend enforces `not`, and both enforce `oneOf` as `anyOf`; checked decoding enforces them
after the fact (services/engine/structured/checked.py), at the cost of holding the stream and
going back. Real schemas mostly use them in shapes that other keywords say exactly:
- `not: {type: T}`: the other types;
- `not: {enum: [...]}` or `not: {const: x}` over a node whose values are listed (an enum, a
  const, a boolean): the values left; over a plain string: a pattern matching every other string
  (xgrammar's patterns take no escaped character: such a string has none);
- `not: {required: [k]}`, or an `anyOf` of such: an object without k, where the object allows
  no properties but those it lists;
- a `oneOf` whose branches no value can match two of (their types, their listed values, or a
  property one of them requires with listed values tell them apart): the same as `anyOf`;
- `unevaluatedProperties`/`unevaluatedItems` with no applicator beside them: `additional*`.
Any other shape stays, and the check enforces it. Outputs are validated against the schema as
sent, never this one, so a fold can narrow what the grammar allows but never let through a
value the schema refuses unnoticed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.grammar.fidelity import VALUE_KEYWORDS

_NOTES = frozenset({"title", "description", "$comment", "examples", "default"})
_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")
_STRING_SHAPES = ("pattern", "format", "minLength", "maxLength")
_MAX_EXCLUDED_CHARS = 512  # a pattern for "any string but these" grows with their length
_MAX_BRANCHES = 64  # pairs compared for a oneOf
_UNEVALUATED = ("unevaluatedProperties", "unevaluatedItems")
_APPLICATORS = frozenset(
    {"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef"}
    | {"dependentSchemas", "dependencies"}
)


@dataclass(frozen=True)
class Folded:
    """The schema a grammar is built from, and what it leaves out for the check to enforce (as
    fidelity findings: `#/path/keyword: not enforced`)."""

    schema: Any
    left: list[str] = field(default_factory=list)


def folded(schema: Any, strict: bool = True) -> Folded:
    """`schema` with every fold above made (a copy: the caller's schema is not changed).
    `strict`: an object that lists properties allows no others unless it says so (the
    request's `strict`, as the backends read it)."""
    left: list[str] = []
    return Folded(_fold(schema, schema, strict, "#", left), left)


def _fold(node: Any, root: Any, strict: bool, path: str, left: list[str]) -> Any:
    if isinstance(node, list):
        return [_fold(x, root, strict, f"{path}/{i}", left) for i, x in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        at = f"{path}/{key}"
        if key in VALUE_KEYWORDS:
            out[key] = value
        elif key in _MAPS and isinstance(value, dict):
            out[key] = {n: _fold(c, root, strict, f"{at}/{n}", left) for n, c in value.items()}
        else:
            out[key] = _fold(value, root, strict, at, left)
    negated = _resolve(out.get("not"), root)
    if isinstance(negated, dict):
        out = _without(out, negated, strict) or out
    branches = out.get("oneOf")
    if isinstance(branches, list) and "anyOf" not in out and _exclusive(branches, out, root):
        out["anyOf"] = out.pop("oneOf")
    for key in _UNEVALUATED:
        if key in out:
            _unevaluated(out, key, path, left)
    return out


def _unevaluated(out: dict[str, Any], key: str, path: str, left: list[str]) -> None:
    """`unevaluatedProperties`/`Items` where nothing applies in place beside them says what
    `additionalProperties`/`items` says; beside an applicator it depends on which branch
    matched, which no grammar follows (xgrammar reads it as `additional*`, refusing valid
    values; llguidance ignores it): out of the grammar, left to the check."""
    applicators = _APPLICATORS | ({"contains"} if key == "unevaluatedItems" else set())
    items = out.get("items")
    sibling = {
        "unevaluatedProperties": "additionalProperties",
        "unevaluatedItems": "additionalItems" if isinstance(items, list) else "items",
    }[key]
    value = out.pop(key)
    if applicators & set(out):
        left.append(f"{path}/{key}: not enforced")
    elif sibling not in out:  # else every property (item) is evaluated by the sibling
        out[sibling] = value


def _resolve(node: Any, root: Any, hops: int = 8) -> Any:
    """A local `{"$ref": "#/..."}` followed to what it names (a few hops); else the node."""
    while hops and isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        if not ref.startswith("#") or set(node) - _NOTES - {"$ref"}:
            return node
        target = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        node, hops = target, hops - 1
    return node


def _types(node: dict[str, Any]) -> set[str]:
    """The declared types ('number' includes 'integer'); empty when undeclared."""
    kind = node.get("type")
    listed = kind if isinstance(kind, list) else [kind]
    names = {k for k in listed if isinstance(k, str)}
    return names | {"integer"} if "number" in names else names


def _type_value(names: set[str]) -> str | list[str]:
    ordered = [t for t in _TYPES if t in names and not (t == "integer" and "number" in names)]
    return ordered[0] if len(ordered) == 1 else ordered


def _canon(value: Any) -> str:
    """JSON equality as the schema means it: 1 == 1.0, true != 1."""

    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


def _shared(a: list[Any], b: list[Any]) -> bool:
    return bool({_canon(v) for v in a} & {_canon(v) for v in b})


def _listed(node: dict[str, Any]) -> list[Any] | None:
    """The values a node lists (const, enum, or a boolean/null type); None when unlisted."""
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    types = _types(node)
    if types and types <= {"boolean", "null"}:
        return ([True, False] if "boolean" in types else []) + ([None] if "null" in types else [])
    return None


def _fits(value: Any, types: set[str]) -> bool:
    if not types:
        return True
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer" in types
    kinds = {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}
    return kinds.get(type(value)) in types


def _without(node: dict[str, Any], negated: dict[str, Any], strict: bool) -> dict[str, Any] | None:
    """`node` with its `not` said in other keywords; None when this shape is not folded."""
    rest = {k: v for k, v in node.items() if k != "not"}
    keys = set(negated) - _NOTES
    if keys == {"type"}:
        return _without_types(rest, _types(negated))
    if keys in ({"enum"}, {"const"}):
        excluded = _listed(negated)
        return None if excluded is None else _without_values(rest, excluded)
    absent = _required_names(negated)
    if absent:
        return _without_properties(rest, absent, strict)
    return None


def _without_types(rest: dict[str, Any], excluded: set[str]) -> dict[str, Any] | None:
    allowed = _types(rest) or set(_TYPES)
    if "integer" in excluded and "number" in allowed and "number" not in excluded:
        return None  # "a number that is not an integer" has no type of its own
    left = allowed - excluded
    return {**rest, "type": _type_value(left)} if left else None


def _without_values(rest: dict[str, Any], excluded: list[Any]) -> dict[str, Any] | None:
    out = {**rest}
    gone = {_canon(v) for v in excluded}
    values = _listed(rest)
    if values is not None:
        left = [v for v in values if _canon(v) not in gone]
        if not left:
            return None
        out.pop("const", None)
        out["enum"] = left
        return out
    if _types(rest) != {"string"} or any(k in rest for k in _STRING_SHAPES):
        return None
    strings = sorted({v for v in excluded if isinstance(v, str)})
    if sum(len(s) + 1 for s in strings) > _MAX_EXCLUDED_CHARS:
        return None
    if strings:
        out["pattern"] = "^" + _other_strings(strings) + "$"
    return out


def _required_names(negated: dict[str, Any]) -> list[str]:
    """k of `{required: [k]}`, or every k of `{anyOf: [{required: [k]}, ...]}`; else []."""
    keys = set(negated) - _NOTES
    branches = [negated] if keys == {"required"} else negated.get("anyOf")
    if not isinstance(branches, list) or (keys != {"required"} and keys != {"anyOf"}):
        return []
    names = []
    for branch in branches:
        if not isinstance(branch, dict) or set(branch) - _NOTES != {"required"}:
            return []
        required = branch["required"]
        if not isinstance(required, list):
            return []
        if len(required) != 1 or not isinstance(required[0], str):
            return []
        names.append(required[0])
    return names


def _without_properties(
    rest: dict[str, Any], absent: list[str], strict: bool
) -> dict[str, Any] | None:
    """An object without the `absent` properties: dropped from `properties` where no other
    property may appear (xgrammar refuses a `false` subschema). `required` holds for any value
    that is not an object, so `not: {required: [k]}` refuses every such value: type object."""
    types = _types(rest)
    required = rest.get("required")
    if (types and "object" not in types) or (
        isinstance(required, list) and any(name in required for name in absent)
    ):
        return None
    others = rest.get("additionalProperties", not strict)
    if others is not False or rest.get("patternProperties") or "unevaluatedProperties" in rest:
        return None
    properties = rest.get("properties")
    if not isinstance(properties, dict):
        properties = {}
    return {
        **rest,
        "type": "object",
        "properties": {k: v for k, v in properties.items() if k not in absent},
        "additionalProperties": False,
    }


def _other_strings(excluded: list[str]) -> str:
    """A regex (no anchors) matching every string but the `excluded` ones."""
    trie: dict[str, Any] = {}
    for word in excluded:
        at = trie
        for char in word:
            at = at.setdefault(char, {})
        at[""] = {}  # the end of a word

    def other(at: dict[str, Any]) -> str:
        starts = sorted(c for c in at if c)
        parts = [] if "" in at else [""]  # the string may end here unless a word does
        parts.append(
            "[^" + "".join(_class_char(c) for c in starts) + "][\\s\\S]*" if starts else "[\\s\\S]+"
        )
        parts += [re.escape(c) + other(at[c]) for c in starts]
        return "(?:" + "|".join(parts) + ")"

    return other(trie)


def _class_char(char: str) -> str:
    return "\\" + char if char in "\\]^-[" else char


def _exclusive(branches: list[Any], node: dict[str, Any], root: Any) -> bool:
    """True when no value the node allows can match two of its `oneOf` branches (so `oneOf`
    says what `anyOf` says)."""
    resolved = [_resolve(b, root) for b in branches]
    if len(resolved) > _MAX_BRANCHES or not all(isinstance(b, dict) for b in resolved):
        return False
    within = _types(node) or set(_TYPES)
    return all(
        _apart(a, b, within, root) for i, a in enumerate(resolved) for b in resolved[i + 1 :]
    )


def _apart(a: dict[str, Any], b: dict[str, Any], within: set[str], root: Any) -> bool:
    """No value of the types `within` matches both `a` and `b`."""
    ta, tb = (_types(a) or set(_TYPES)) & within, (_types(b) or set(_TYPES)) & within
    if not ta & tb:
        return True
    va, vb = _listed(a), _listed(b)
    if va is not None and vb is not None and not _shared(va, vb):
        return True
    if va is not None and not any(_fits(v, tb) for v in va):
        return True
    if vb is not None and not any(_fits(v, ta) for v in vb):
        return True
    if (ta & tb) - {"object"}:  # `required` and `properties` hold for every other value
        return False
    return _told_by_property(a, b, root) or _told_by_property(b, a, root)


def _told_by_property(a: dict[str, Any], b: dict[str, Any], root: Any) -> bool:
    """A property `a` requires, whose listed values in `a` and in `b` share none."""
    pa, pb = a.get("properties"), b.get("properties")
    required = a.get("required")
    if not isinstance(pa, dict) or not isinstance(pb, dict) or not isinstance(required, list):
        return False
    for name in required:
        sa, sb = _resolve(pa.get(name), root), _resolve(pb.get(name), root)
        if not isinstance(sa, dict) or not isinstance(sb, dict):
            continue
        va, vb = _listed(sa), _listed(sb)
        if va is not None and vb is not None and not _shared(va, vb):
            return True
    return False
