"""The xgrammar backend on the real SmolLM2 tokenizer (no model needed)."""

import re

import pydantic
import pytest

from services import StructuredOutput
from services.grammar import GrammarError
from services.grammar.backends import Backends
from services.grammar.xgrammar_backend import XGrammarBackend


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XGrammarBackend(tokenizer, 49152, stop_token_ids=[2])


def walk(backend, tokenizer, spec, text):
    """Feeds `text` token by token; returns (all accepted, terminated after EOS)."""
    state = backend.new_state(backend.compile(spec))
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not state.accept_token(t):
            return False, False
    return True, state.accept_token(2) and state.is_terminated()


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (StructuredOutput(json_schema=Person), '{"name": "Ann", "age": 3}', '{"name": 3}'),
        (StructuredOutput(json_schema='{"type": "integer"}'), "42", "4.2"),
        (StructuredOutput(json_object=True), '{"any": [1, 2]}', "[1, 2]"),
        (StructuredOutput(regex=r"\d{3}-\d{4}"), "555-1234", "5551234"),
        (StructuredOutput(choice=["a.b", "c"]), "a.b", "axb"),
        (StructuredOutput(grammar='root ::= "yes" | "no"'), "no", "maybe"),
        (StructuredOutput(grammar='start: "yes" | "no"'), "yes", "nope"),
        (
            StructuredOutput(json_schema=Person, compact=True),
            '{"name":"A","age":1}',
            '{"name": "A"',
        ),
    ],
)
def test_each_kind_accepts_what_it_should(backend, tokenizer, spec, good, bad):
    assert walk(backend, tokenizer, spec, good) == (True, True)
    accepted, terminated = walk(backend, tokenizer, spec, bad)
    assert not (accepted and terminated)


def test_structural_tag_constrains_only_inside_the_tag(backend, tokenizer):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool>"],
            "tags": [
                {
                    "begin": "<tool>",
                    "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
                    "end": "</tool>",
                }
            ],
        },
    }
    spec = StructuredOutput(structural_tag=tag)
    assert walk(backend, tokenizer, spec, "free text <tool>12</tool> more") == (True, True)
    assert walk(backend, tokenizer, spec, "free text <tool>x</tool>")[0] is False


def test_whitespace_is_capped_by_default(backend, tokenizer):
    spec = StructuredOutput(json_schema={"type": "object"})
    assert walk(backend, tokenizer, spec, "{" + " " * 8 + "}")[0]
    assert not walk(backend, tokenizer, spec, "{" + " " * 30 + "}")[0]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (StructuredOutput(regex="("), "structured.regex"),
        (StructuredOutput(json_schema="{not json"), "structured.json_schema"),
        (StructuredOutput(grammar="root ::= undefined_rule"), "structured.grammar"),
        (StructuredOutput(json_schema={"uniqueItems": True}, fidelity="strict"), "cannot enforce"),
        (StructuredOutput(grammar_id="g-123"), "structured.grammar_id"),
    ],
)
def test_bad_grammars_raise_a_clear_error(backend, spec, field):
    with pytest.raises(GrammarError, match=re.escape(field)) as info:
        backend.compile(spec)
    assert ".cc:" not in str(info.value)  # no C++ source locations leak to callers


def test_warn_fidelity_compiles_and_reports(backend):
    compiled = backend.compile(StructuredOutput(json_schema={"type": "array", "uniqueItems": True}))
    assert compiled.warnings == ["#/uniqueItems: not enforced"]


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "auto"])
def test_a_remote_ref_is_refused_by_name_and_never_fetched(tokenizer, name):
    """No backend resolves one (xgrammar compiled it as any value, so every output then failed
    validation): refused with its path, a local `$ref` beside it still compiles."""
    backends = Backends(tokenizer, 49152, [2], name)
    remote = {"properties": {"a": {"$ref": "http://169.254.169.254/latest/meta-data"}}}
    with pytest.raises(GrammarError, match=r"remote \$ref is not fetched \(#/properties/a/\$ref"):
        backends.compile(StructuredOutput(json_schema=remote))
    local = {"$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/s"}}}
    assert backends.compile(StructuredOutput(json_schema=local)).warnings == []
