"""Outputs that finish: unbounded integers and numbers get bounds the real xgrammar enforces,
and a short unit repeated inside a string is told apart from repeated data."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from services.grammar.finish import INT64, bounded, repeated_unit


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))


def takes(compiler, schema, text: str) -> bool:
    return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema))).accept_string(text)


def test_unbounded_integers_get_the_64_bit_range(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = bounded(schema)
    assert out["properties"]["n"] == {"type": "integer", "minimum": INT64[0], "maximum": INT64[1]}
    assert schema["properties"]["n"] == {"type": "integer"}  # the caller's is untouched
    assert takes(compiler, out, '{"n": 9223372036854775807}')
    assert not takes(compiler, out, '{"n": 92233720368547758070')
    assert takes(compiler, schema, '{"n": 92233720368547758070')  # what it was before


def test_numbers_get_a_cap_on_digits(compiler):
    out = bounded({"type": "number"})
    assert takes(compiler, out, "-123456.125")
    assert not takes(compiler, out, "1" * 17)
    assert takes(compiler, {"type": "number"}, "1" * 17)


def test_given_bounds_data_and_mixed_types_are_kept():
    assert bounded({"type": "integer", "minimum": 0}) == {
        "type": "integer",
        "minimum": 0,
        "maximum": INT64[1],
    }
    assert bounded({"type": "integer", "exclusiveMaximum": 5})["exclusiveMaximum"] == 5
    assert "maximum" not in bounded({"type": "integer", "exclusiveMaximum": 5})
    assert bounded({"const": {"type": "integer"}}) == {"const": {"type": "integer"}}
    assert bounded({"type": ["integer", "string"]}) == {"type": ["integer", "string"]}
    # a condition keeps its meaning: bounds inside `not` or `if` would widen the schema
    negated = {"not": {"type": "integer"}, "if": {"type": "integer"}, "then": {"type": "integer"}}
    out = bounded(negated)
    assert out["not"] == {"type": "integer"} and out["if"] == {"type": "integer"}
    assert out["then"]["maximum"] == INT64[1]
    nested = bounded({"items": {"anyOf": [{"type": "number"}, {"type": "null"}]}})
    assert nested["items"]["anyOf"][0]["maximum"] == 1e15


def test_a_repeated_unit_inside_a_string_is_a_loop_and_data_is_not():
    words = {1: "ha", 2: ", ", 3: "0", 4: " ho", 5: ":", 6: '"', 7: "true"}
    decode = lambda ids: "".join(words[i] for i in ids)  # noqa: E731
    assert repeated_unit([1] * 128, decode) == "ha"
    assert repeated_unit([1, 4] * 64, decode) == "ha ho"
    assert repeated_unit([3] * 128, decode) == "0"  # numbers are bounded: this is a string
    assert repeated_unit([1, 5] * 64, decode) == "ha:"
    assert repeated_unit(list(range(1, 6)) * 26, decode) is not None  # 5 tokens a unit
    assert repeated_unit([3, 2] * 64, decode) is None  # a list of zeros
    assert repeated_unit([7, 2] * 64, decode) is None  # of trues
    assert repeated_unit([6, 1, 6, 2] * 32, decode) is None  # of strings
    assert repeated_unit([1] * 100 + [4] * 28, decode) is None
