"""The folds of `not` and `oneOf` say exactly what the schema says (jsonschema judges both on the
same instances), and shapes they cannot say stay as they were, for the check."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from services.grammar.fidelity import loosened_keywords
from services.grammar.fold import folded

INSTANCES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    1.5,
    -7,
    "",
    "a",
    "b",
    "in",
    "intramural",
    "intramurals",
    "inter",
    "x\ny",
    [],
    [1],
    [1, 2],
    [1, "a"],
    {},
    {"a": 1},
    {"b": "x"},
    {"a": 1, "b": "x"},
    {"k": "x", "v": 1},
    {"k": "y", "w": "s"},
    {"k": "z"},
    {"c": None},
]

FOLDED = {
    "not type": {"not": {"type": "number"}},
    "not type, typed": {"type": ["string", "integer"], "not": {"type": "string"}},
    "not enum, listed": {"type": "string", "enum": ["a", "b", "in"], "not": {"enum": ["b"]}},
    "not const, boolean": {"type": "boolean", "not": {"const": True}},
    "not enum, string": {"type": "string", "not": {"enum": ["intramural", "in", "a-]^\\"]}},
    "not enum, string, other types excluded": {"type": "string", "not": {"enum": [1, None]}},
    "not required": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "not": {"required": ["a"]},
    },
    "not anyOf required, untyped": {
        "properties": {"a": {}, "b": {}, "c": {}},
        "not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
    },
    "not $ref": {"$defs": {"n": {"type": "null"}}, "not": {"$ref": "#/$defs/n"}},
    "oneOf by type": {"oneOf": [{"type": "string"}, {"type": "array"}, {"type": "null"}]},
    "oneOf by values": {"oneOf": [{"enum": ["a", "b"]}, {"const": "in"}, {"type": "integer"}]},
    "oneOf by a required const": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"k": {"const": "x"}, "v": {"type": "integer"}},
                "required": ["k"],
            },
            {"$ref": "#/$defs/y"},
        ],
        "$defs": {"y": {"type": "object", "properties": {"k": {"enum": ["y"]}}, "required": ["k"]}},
    },
    "oneOf by a required const, the node typed": {
        "type": "object",
        "oneOf": [
            {"properties": {"k": {"const": "x"}}, "required": ["k"]},
            {"properties": {"k": {"const": "y"}}, "required": ["k"]},
        ],
    },
    "unevaluatedProperties, nothing beside": {
        "properties": {"a": {}},
        "unevaluatedProperties": {"type": "integer"},
    },
    "unevaluatedItems after prefixItems": {
        "prefixItems": [{"type": "integer"}],
        "unevaluatedItems": False,
    },
    "unevaluatedItems beside items": {"items": {"type": "integer"}, "unevaluatedItems": False},
}

KEPT = {
    "not a number that is an integer": {"type": "number", "not": {"type": "integer"}},
    "not every type": {"type": "string", "not": {"type": "string"}},
    "not a pattern": {"type": "string", "not": {"pattern": "^a"}},
    "not enum beside a length": {"type": "string", "minLength": 1, "not": {"enum": ["a"]}},
    "not required, others allowed": {
        "type": "object",
        "properties": {"a": {}},
        "additionalProperties": True,
        "not": {"required": ["a"]},
    },
    "not required, and required": {"required": ["a"], "not": {"required": ["a"]}},
    "not two required": {"type": "object", "not": {"required": ["a", "b"]}},
    "oneOf overlapping": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "oneOf by property, strings match both": {
        "oneOf": [
            {"properties": {"k": {"const": "x"}}, "required": ["k"]},
            {"properties": {"k": {"const": "y"}}, "required": ["k"]},
        ]
    },
    "oneOf by an optional property": {
        "oneOf": [
            {"type": "object", "properties": {"k": {"const": "x"}}},
            {"type": "object", "properties": {"k": {"const": "y"}}},
        ]
    },
}


def _closed(schema: Any) -> Any:
    """What `strict` means to the backends: listed properties and no others."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items() if k not in ("enum", "const")}
    out.update({k: schema[k] for k in ("enum", "const") if k in schema})
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        if "unevaluatedProperties" not in schema:
            out.setdefault("additionalProperties", False)
    return out


@pytest.mark.parametrize("name", list(FOLDED))
def test_a_fold_says_what_the_schema_says(name: str) -> None:
    schema = FOLDED[name]
    grammar = folded(schema).schema
    assert not {"not", "oneOf"} & _keywords(grammar), grammar
    assert not [w for w in loosened_keywords(grammar) if "/not:" in w or "/oneOf:" in w]
    want = jsonschema.Draft202012Validator(_closed(schema))
    got = jsonschema.Draft202012Validator(_closed(grammar))
    for instance in INSTANCES:
        assert want.is_valid(instance) == got.is_valid(instance), (instance, grammar)


@pytest.mark.parametrize("name", list(KEPT))
def test_a_shape_no_keyword_says_is_kept_for_the_check(name: str) -> None:
    schema = KEPT[name]
    assert folded(schema).schema == schema


def test_unevaluated_beside_an_applicator_is_left_to_the_check() -> None:
    schema = {
        "type": "object",
        "properties": {
            "x": {"anyOf": [{"prefixItems": [{"type": "integer"}]}], "unevaluatedItems": False}
        },
        "allOf": [{"properties": {"a": {}}}],
        "unevaluatedProperties": False,
    }
    found = folded(schema)
    assert "unevaluatedProperties" not in found.schema
    assert "unevaluatedItems" not in found.schema["properties"]["x"]
    assert sorted(found.left) == [
        "#/properties/x/unevaluatedItems: not enforced",
        "#/unevaluatedProperties: not enforced",
    ]


def test_the_callers_schema_is_not_changed_and_values_are_not_schemas() -> None:
    schema = {
        "type": "object",
        "properties": {"not": {"not": {"type": "string"}}, "oneOf": {"type": "integer"}},
        "default": {"not": {"type": "string"}},
        "required": ["not"],
    }
    before = repr(schema)
    grammar = folded(schema).schema
    assert repr(schema) == before
    assert grammar["default"] == schema["default"]  # data, left alone
    not_string = ["number", "boolean", "null", "array", "object"]
    assert grammar["properties"]["not"] == {"type": not_string}
    assert grammar["properties"]["oneOf"] == {"type": "integer"}


@pytest.mark.parametrize(
    "schema",
    [
        {"not": {"anyOf": [True, {"required": ["a"]}]}},
        {"type": [{}], "not": {"type": [None]}},
        {"oneOf": [True, False], "not": {"required": "a"}},
        {"not": {"enum": [{"a": [1]}, [{}]]}, "enum": [{"a": [1.0]}, 2]},
    ],
)
def test_a_schema_of_any_shape_is_folded_without_failing(schema: Any) -> None:
    assert isinstance(folded(schema).schema, dict)


def test_not_required_without_strict_needs_closed_objects() -> None:
    schema = {"type": "object", "properties": {"a": {}}, "not": {"required": ["a"]}}
    assert folded(schema, strict=False).schema == schema
    assert folded(schema, strict=True).schema["properties"] == {}


def _keywords(node: Any) -> set[str]:
    if isinstance(node, list):
        return {k for x in node for k in _keywords(x)}
    if not isinstance(node, dict):
        return set()
    found = set()
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):
            continue
        if key in ("properties", "$defs"):
            found |= {k for x in value.values() for k in _keywords(x)}
        else:
            found |= {key} | _keywords(value)
    return found
