"""The llguidance backend against xgrammar's on the real tokenizer: the same masks where both
enforce the same language, accept / terminate / roll back, jump-forward text, and refusals by
name (what llguidance cannot enforce is an error, not a loosened grammar)."""

from __future__ import annotations

import pytest
import torch

from services.grammar.backend import GrammarError
from services.grammar.llguidance_backend import LLGuidanceBackend, _utf8_prefix
from services.grammar.structured import StructuredOutput
from services.grammar.xgrammar_backend import XGrammarBackend


@pytest.fixture(scope="module")
def backends(loaded_model):
    tok = loaded_model.tokenizer
    vocab = int(loaded_model.model.config.vocab_size)
    stop = [tok.eos_token_id]
    return LLGuidanceBackend(tok, vocab, stop), XGrammarBackend(tok, vocab, stop)


def allowed(backend, state) -> torch.Tensor:
    mask = backend.allocate_bitmask(1)
    state.fill_bitmask(mask, 0)
    bits = torch.arange(32, dtype=torch.int32)
    return ((mask[0, :, None] >> bits) & 1).reshape(-1)[: backend.vocab_size].bool()


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        # `[0-9]`, not `\d`: llguidance's `\d` is any Unicode digit, xgrammar's ASCII only
        (StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}"), "555-1234"),
        (StructuredOutput(choice=["red", "green", "blue"]), "green"),
        (StructuredOutput(grammar='root ::= "yes" | "no"'), "no"),
    ],
)
def test_the_same_language_gives_the_same_masks_step_by_step(backends, tokenizer, spec, text):
    llg, xg = backends
    a, b = llg.new_state(llg.compile(spec)), xg.new_state(xg.compile(spec))
    for token in [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]:
        assert torch.equal(allowed(llg, a), allowed(xg, b))
        assert a.accept_token(token) and b.accept_token(token)
    assert a.is_terminated() and b.is_terminated()


def test_a_schema_output_is_accepted_and_an_invalid_token_refused(backends, tokenizer):
    llg, _ = backends
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    }
    compiled = llg.compile(StructuredOutput(json_schema=schema))
    assert compiled.schema is not None
    state = llg.new_state(compiled)
    ids = tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    for token in ids:
        assert allowed(llg, state)[token] and state.accept_token(token)
    assert not allowed(llg, state)[tokenizer.encode(",", add_special_tokens=False)[0]]
    assert state.accept_token(tokenizer.eos_token_id) and state.is_terminated()
    state.rollback(2)  # the end-of-sequence (not recorded by llguidance) and the `}`
    assert not state.is_terminated() and allowed(llg, state)[ids[-1]]


def test_compact_json_allows_no_whitespace(backends, tokenizer):
    llg, _ = backends
    spec = StructuredOutput(json_schema={"type": "object"}, compact=True)
    state = llg.new_state(llg.compile(spec))
    state.accept_token(tokenizer.encode("{", add_special_tokens=False)[0])
    space = tokenizer.encode(" ", add_special_tokens=False)[0]
    assert not allowed(llg, state)[space]


def test_jump_forward_gives_the_forced_text(backends):
    llg, _ = backends
    spec = StructuredOutput(
        json_schema={
            "type": "object",
            "properties": {"colour": {"enum": ["teal"]}},
            "required": ["colour"],
        },
        compact=True,
    )
    assert llg.new_state(llg.compile(spec)).jump_forward() == '{"colour":"teal"}'  # closed
    assert _utf8_prefix("é".encode()[:1]) == "" and _utf8_prefix("aé".encode()) == "aé"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            StructuredOutput(json_schema={"type": "array", "uniqueItems": True}, fidelity="strict"),
            "#/uniqueItems: not enforced",
        ),
        (StructuredOutput(regex="(unclosed"), "structured.regex"),
        (StructuredOutput(grammar="start: undefined_rule"), "structured.grammar"),
        (StructuredOutput(structural_tag={"type": "structural_tag"}), "structural_tag"),
    ],
)
def test_what_it_cannot_enforce_or_parse_is_refused_by_name(backends, spec, field):
    llg, _ = backends
    with pytest.raises(GrammarError, match=field):
        llg.compile(spec)


def test_keywords_it_cannot_enforce_are_listed_under_warn(backends):
    llg, _ = backends
    schema = {"type": "object", "properties": {"a": {"not": {"pattern": "^a"}}}}
    compiled = llg.compile(StructuredOutput(json_schema={**schema, "uniqueItems": True}))
    assert sorted(compiled.warnings) == [
        "#/properties/a/not: not enforced",  # the fidelity report's wording and paths
        "#/uniqueItems: not enforced",
    ]


def test_strict_mode_closes_objects_that_list_properties(backends, tokenizer):
    llg, _ = backends
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for strict, extra_allowed in ((True, False), (False, True)):
        state = llg.new_state(llg.compile(StructuredOutput(json_schema=schema, strict=strict)))
        for token in tokenizer.encode('{"a": 1', add_special_tokens=False):
            assert state.accept_token(token)
        comma = tokenizer.encode(",", add_special_tokens=False)[0]
        assert bool(allowed(llg, state)[comma]) is extra_allowed


def test_a_refused_token_leaves_the_state_usable(backends, tokenizer):
    """Jump-forward offers tokens the grammar may refuse and then goes on with the state."""
    llg, _ = backends
    state = llg.new_state(llg.compile(StructuredOutput(regex="[0-9]{3}")))
    letter, one = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("x", "1"))
    assert not state.accept_token(letter) and not state.accept_token(tokenizer.eos_token_id)
    assert allowed(llg, state)[one] and state.accept_token(one)


def test_parser_limits_come_from_grammar_limits_and_bound_every_mask(loaded_model, tokenizer):
    """A grammar past the lexer's limits fails its mask with a 422, where llguidance alone
    would allow only end-of-sequence (an output that ends early and looks complete)."""
    from grammar_registry.limits import GrammarLimits

    limits = GrammarLimits(max_lexer_states=50, mask_parser_items=4321, build_lexer_fuel=98765)
    vocab = int(loaded_model.model.config.vocab_size)
    llg = LLGuidanceBackend(tokenizer, vocab, [tokenizer.eos_token_id], limits=limits)
    assert (llg.limits.max_lexer_states, llg.limits.step_max_items) == (50, 4321)
    assert llg.limits.initial_lexer_fuel == 98765
    state = llg.new_state(llg.compile(StructuredOutput(regex='"' + "abcdefghij" * 6 + ".*")))
    mask = llg.allocate_bitmask(1)
    with pytest.raises(GrammarError, match="parser's limits") as err:
        for _ in range(64):
            state.fill_bitmask(mask, 0)
            state.accept_string(state.jump_forward() or "a")
    assert err.value.status == 422 and err.value.reason == "limit"
