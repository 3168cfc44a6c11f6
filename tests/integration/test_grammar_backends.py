"""The backends by name and `auto`'s choice per grammar (services/grammar/backends.py),
on the real tokenizer: which backend each kind of grammar gets, fidelity under `auto`, and one
bitmask filled by rows of both backends."""

from __future__ import annotations

import pytest
import torch

from services.grammar.backend import GrammarError
from services.grammar.backends import Backends
from services.grammar.structured import StructuredOutput, check_name

PLAIN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


@pytest.fixture(scope="module")
def backends(loaded_model):
    tok = loaded_model.tokenizer
    return Backends(tok, int(loaded_model.model.config.vocab_size), [tok.eos_token_id], "auto")


def test_auto_takes_llguidance_for_schemas_it_enforces(backends):
    compiled = backends.compile(StructuredOutput(json_schema=PLAIN))
    assert compiled.backend == "llguidance" and compiled.warnings == []
    assert backends.compile(StructuredOutput(json_object=True)).backend == "llguidance"


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(regex=r"\d+"),
        StructuredOutput(choice=["a", "b"]),
        StructuredOutput(grammar='root ::= "yes"'),
    ],
)
def test_auto_keeps_xgrammar_for_its_dialects(backends, spec):
    assert backends.compile(spec).backend == "xgrammar"


def test_auto_reports_what_neither_enforces_and_strict_refuses_it(backends):
    compiled = backends.compile(StructuredOutput(json_schema=UNIQUE))
    assert compiled.warnings and any("uniqueItems" in w for w in compiled.warnings)
    with pytest.raises(GrammarError) as err:
        backends.compile(StructuredOutput(json_schema=UNIQUE, fidelity="strict"))
    assert err.value.reason == "fidelity"


def test_a_pinned_backend_is_used_as_asked(backends):
    pinned = backends.compile(StructuredOutput(json_schema=PLAIN, backend="xgrammar"))
    assert pinned.backend == "xgrammar"
    with pytest.raises(GrammarError, match="uniqueItems"):
        backends.compile(
            StructuredOutput(json_schema=UNIQUE, backend="llguidance", fidelity="strict")
        )


def test_rows_of_both_backends_share_one_bitmask(backends, tokenizer):
    a = backends.new_state(backends.compile(StructuredOutput(json_schema=PLAIN)))
    b = backends.new_state(backends.compile(StructuredOutput(regex="[0-9]+")))
    mask = backends.allocate_bitmask(2)
    assert a.fill_bitmask(mask, 0) and b.fill_bitmask(mask, 1)
    logits = torch.zeros(2, backends.vocab_size)
    backends.apply_bitmask(logits, mask, [0, 1])
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    seven = tokenizer.encode("7", add_special_tokens=False)[0]
    assert logits[0, brace] == 0 and logits[0, seven] == float("-inf")
    assert logits[1, seven] == 0 and logits[1, brace] == float("-inf")


def test_names_are_checked():
    check_name("grammar_backend", "auto")
    with pytest.raises(ValueError, match="grammar_backend: 'outlines'"):
        check_name("grammar_backend", "outlines")


def test_an_llguidance_engine_never_builds_xgrammar(loaded_model, tokenizer):
    """The shared bitmask needs no backend: no tokenizer scan for xgrammar."""
    vocab = int(loaded_model.model.config.vocab_size)
    guided = Backends(tokenizer, vocab, [tokenizer.eos_token_id], "llguidance")
    state = guided.new_state(guided.compile(StructuredOutput(json_schema=PLAIN)))
    mask = guided.allocate_bitmask(1)
    state.fill_bitmask(mask, 0)
    logits = torch.zeros(1, vocab)
    guided.apply_bitmask(logits, mask, [0])
    assert torch.isinf(logits).any() and guided._xgrammar is None
