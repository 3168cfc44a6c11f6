"""HTTP bodies to engine parameters: every field is honoured, refused by name, or harmless."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from deployments.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    template_options,
)
from deployments.translate import sampling_from
from services.engine.params import SamplingParams
from services.grammar.structured import StructuredOutput

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def params(**fields):
    return sampling_from(ChatCompletionRequest.model_validate({**CHAT, **fields}), 512)


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
        ({"regex": "a+"}, "regex", "a+"),  # SGLang's
        ({"ebnf": 'root ::= "y"'}, "grammar", 'root ::= "y"'),
        ({"json_schema": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ],
)
def test_every_name_for_a_constraint_reaches_the_engine(fields, kind, value):
    structured = params(**fields).structured
    assert structured is not None and structured.kind == kind
    assert getattr(structured, kind) == value


def test_two_constraints_at_once_name_both():
    with pytest.raises(BadRequest, match="guided_regex") as err:
        params(guided_regex="a", structured_outputs={"regex": "b"})
    assert "structured_outputs" in str(err.value)


def test_structured_outputs_options_are_honoured_or_refused():
    so = {"json": SCHEMA, "disable_any_whitespace": True, "disable_additional_properties": True}
    structured = params(structured_outputs=so).structured
    assert structured.compact and structured.strict
    with pytest.raises(BadRequest, match="whitespace_pattern"):
        params(structured_outputs={"json": SCHEMA, "whitespace_pattern": r"\s?"})
    with pytest.raises(BadRequest, match="guided_whitespace_pattern"):
        params(guided_json=SCHEMA, guided_whitespace_pattern=r"\s?")


def test_sampling_controls_reach_the_engine():
    sp = params(
        top_k=-1,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"42": -100, "7": 3.5},
        min_tokens=4,
        stop_token_ids=[2],
        logprobs=True,
        top_logprobs=5,
        max_tokens=64,
    )
    assert (sp.top_k, sp.min_p, sp.presence_penalty, sp.frequency_penalty) == (0, 0.1, 0.5, -0.5)
    assert sp.repetition_penalty == 1.2 and sp.logit_bias == {42: -100.0, 7: 3.5}
    assert sp.min_tokens == 4 and sp.stop_token_ids == (2,) and sp.logprobs == 5
    assert sp.max_tokens == 64 and not sp.fit_max_tokens
    assert params(logprobs=True).logprobs == 0 and params().logprobs is None
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 3})
    assert sampling_from(body, 512).logprobs == 3


def test_max_tokens_unset_is_the_context_left_up_to_the_tenant_cap():
    sp = params()
    assert sp.max_tokens == 512 and sp.fit_max_tokens
    with pytest.raises(BadRequest, match="max_tokens"):
        params(max_tokens=513)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"min_tokens": 99, "max_tokens": 8}, "min_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"prompt_logprobs": 3}, "prompt_logprobs"),
    ],
)
def test_what_is_not_honoured_is_refused_by_name(fields, name):
    with pytest.raises((BadRequest, ValidationError)) as err:
        params(**fields)
    assert name in str(err.value)


def test_harmless_fields_are_accepted():
    sp = params(user="u", metadata={"k": "v"}, store=False, service_tier="auto")
    assert sp.max_tokens == 512


def test_chat_template_options_travel_with_the_body():
    body = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert template_options(body) == {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "enable_thinking": False,
    }


TAG_FORMAT = {"type": "tag", "begin": "<a>", "content": {"type": "const_string", "value": "x"}}
TAG_FORMAT |= {"end": "</a>"}


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "structural_tag", "format": TAG_FORMAT}},
        {
            "structured_outputs": {
                "structural_tag": {"type": "structural_tag", "format": TAG_FORMAT}
            }
        },
        {"structured_outputs": {"structural_tag": '{"format": ' + json.dumps(TAG_FORMAT) + "}"}},
    ],
)
def test_structural_tags_in_each_shape_reach_the_engine_as_xgrammars(fields):
    assert params(**fields).structured.structural_tag == {
        "type": "structural_tag",
        "format": TAG_FORMAT,
    }


def test_vllms_older_structural_tag_becomes_triggered_tags():
    older = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
    }
    tag = params(response_format={**older, "triggers": ["<f"]}).structured.structural_tag
    assert tag["format"]["type"] == "triggered_tags" and tag["format"]["triggers"] == ["<f"]
    (only,) = tag["format"]["tags"]
    assert only["begin"] == "<f>" and only["content"]["json_schema"] == SCHEMA
    with pytest.raises(ValidationError, match="structural_tag needs"):
        params(response_format={"type": "structural_tag"})


def test_the_outputs_that_finish_options_can_be_turned_off():
    on = params(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    assert on.structured.bound_numbers and on.structured.max_repeat_run == 128
    so = {"json": SCHEMA, "bound_numbers": False, "max_repeat_run": None}
    off = params(structured_outputs=so).structured
    assert not off.bound_numbers and off.max_repeat_run is None


def test_screen_refuses_a_grammar_over_the_limits_at_the_ingress() -> None:
    from deployments.translate import screen
    from grammar_registry.limits import GrammarLimits

    deep: dict = {"type": "string"}
    for _ in range(80):  # deeper than the nesting limit (64)
        deep = {"type": "array", "items": deep}
    limits = GrammarLimits()
    with pytest.raises(BadRequest) as err:
        screen(SamplingParams(structured=StructuredOutput(json_schema=deep)), limits)
    assert err.value.param == "structured.json_schema" and "max_depth" in str(err.value)
    with pytest.raises(BadRequest, match=r"structured\.regex"):
        screen(SamplingParams(structured=StructuredOutput(regex="a" * 200_000)), limits)
    screen(SamplingParams(structured=StructuredOutput(json_schema={"type": "integer"})), limits)
    screen(SamplingParams(structured=StructuredOutput(grammar_id="gr_x")), limits)  # a lookup
    screen(SamplingParams(), limits)


def test_screen_refuses_a_schema_over_the_size_limit_before_walking_it(monkeypatch) -> None:
    from deployments import translate
    from grammar_registry.limits import GrammarLimits

    walked = []
    monkeypatch.setattr(translate, "to_spec", lambda so: walked.append(so))
    limits = GrammarLimits(max_spec_bytes=1000)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
    with pytest.raises(BadRequest) as err:
        translate.screen(SamplingParams(structured=StructuredOutput(json_schema=big)), limits)
    assert err.value.param == "structured.json_schema" and "max_spec_bytes" in str(err.value)
    assert not walked  # refused on its size alone
    # non-ASCII counts in bytes, as the canonical spec does
    wide = {"enum": ["é" * 600]}  # 600 characters, 1200 bytes
    with pytest.raises(BadRequest, match="max_spec_bytes"):
        translate.screen(SamplingParams(structured=StructuredOutput(json_schema=wide)), limits)


def test_structured_outputs_without_a_kind_sets_options_for_response_format():
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    structured = params(
        response_format=rf,
        structured_outputs={"backend": "llguidance", "disable_any_whitespace": True},
    ).structured
    assert structured.json_schema == SCHEMA and structured.backend == "llguidance"
    assert structured.compact and structured.bound_numbers  # set options only; defaults kept
    with pytest.raises(BadRequest, match="exactly one of") as err:
        params(structured_outputs={"backend": "llguidance"})  # nothing to apply them to
    assert err.value.param == "structured_outputs"
    with pytest.raises(BadRequest, match="exactly one of"):
        params(structured_outputs={"regex": "a", "choice": ["b"]})
