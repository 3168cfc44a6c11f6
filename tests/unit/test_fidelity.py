import pytest

from services.grammar.fidelity import loosened_keywords


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}}, []),
        ({"type": "array", "uniqueItems": True}, ["#/uniqueItems: not enforced"]),
        (
            {"properties": {"tags": {"items": {"not": {"type": "null"}}}}},
            ["#/properties/tags/items/not: not enforced"],
        ),
        ({"type": "number", "multipleOf": 0.5}, ["#/multipleOf: only integers up to 1024"]),
        ({"type": "integer", "multipleOf": 4}, []),
        # xgrammar drops it beside a range (every integer has one under bound_numbers)
        ({"type": "integer", "multipleOf": 3, "maximum": 99}, ["#/multipleOf: not enforced"]),
        (
            {"type": "string", "maxLength": 5, "pattern": "^a+$"},
            ["#/minLength,maxLength: not enforced together with pattern/format"],
        ),
        ({"$ref": "#/$defs/x", "$defs": {"x": {"if": {}}}}, ["#/$defs/x/if: not enforced"]),
        (
            {"anyOf": [{"type": "string"}, {"oneOf": [{}, {}]}]},
            ["#/anyOf/1/oneOf: enforced as anyOf"],
        ),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, ["#/allOf: several branches"]),
        ({"allOf": [{"type": "object"}]}, []),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, ["#/dependentRequired: not"]),
        ({"type": "string", "pattern": "^a$|^b$"}, ["#/pattern: anchors inside"]),
        ({"type": "string", "pattern": "^[a-z^$]+\\$$"}, []),
        # seen in maskbench: decoded outputs that followed the grammar and failed validation
        (
            {"properties": {"a": {}, "b": {}}, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
            ["#/anyOf/0: a branch without a type", "#/anyOf/1: a branch without a type"],
        ),
        ({"anyOf": [{"type": "object", "required": ["a"]}, {"type": "string"}]}, []),
        (
            {"properties": {"name": {}}, "required": ["id", "name"]},
            ["#/required: id not in properties"],
        ),
        (
            {"properties": {"b": {"type": "object", "enum": ["X", "Y"]}}},
            ["#/properties/b/type: contradicts enum/const"],
        ),
        ({"type": ["string", "null"], "enum": ["X", None]}, []),
        ({"type": "integer", "const": True}, ["#/type: contradicts"]),
    ],
)
def test_loosened_keywords_are_found_with_their_path(schema, expected):
    found = loosened_keywords(schema)
    assert len(found) == len(expected)
    for f, e in zip(found, expected, strict=True):
        assert f.startswith(e)
