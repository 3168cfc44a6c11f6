"""`LLM.chat` with tools and thinking on random-weight models with families' chat templates
(tests/chat_templates.py): the dialect detected from the template, calls held to it and split
back into `tool_calls` whose arguments validate, thinking split into `reasoning_text` as the
rendered prompt leaves it, a call cut by max_tokens left out with a warning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import jsonschema
import pytest
from transformers import AutoTokenizer

from services import LLM, SamplingParams, StructuredOutput
from tests.chat_templates import DEEPSEEK_R1, HARMONY, LLAMA31, QWEN3, QWEN3_CODER
from tests.families import build

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer"},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
NOW = {"type": "function", "function": {"name": "now", "parameters": NOTHING}}
ASK = [{"role": "user", "content": "Weather in Oslo for three days?"}]
OFF = {"enable_thinking": False}


@contextmanager
def served(template: str, root, loaded_model, family: str = "qwen3") -> Iterator[LLM]:
    """An LLM on a random-weight `family` model whose tokenizer carries `template`."""
    folder = build(family, root, loaded_model.path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    llm = LLM(str(folder), kv_cache_memory=32 << 20, grammar_workers=0, sandbox_workers=0)
    try:
        yield llm
    finally:
        llm.engine.grammars.shutdown()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, loaded_model):
    with served(QWEN3, tmp_path_factory.mktemp("qwen3"), loaded_model) as llm:
        yield llm


def test_the_dialect_is_the_templates(qwen3):
    assert (qwen3.dialect.tools, qwen3.dialect.reasoning) == ("qwen_3", "qwen_3")
    assert "<tool_call> and <think>" in qwen3.dialect.why


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_calls_are_held_to_the_dialect_and_split_back(qwen3, choice):
    params = SamplingParams(max_tokens=96, temperature=0)
    out = qwen3.chat(
        ASK,
        params,
        tools=[WEATHER, NOW],
        tool_choice=choice,
        parallel_tool_calls=False,
        chat_template_kwargs=OFF,
    )[0]
    assert out.finish_reason == "stop", out.warnings
    assert out.reasoning_text is None and len(out.tool_calls) == 1
    call = out.tool_calls[0]
    if isinstance(choice, dict):
        assert call.name == "get_weather"
    schema = {"get_weather": WEATHER, "now": NOW}[call.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert out.validated is True
    assert out.text.startswith("<tool_call>\n{") and out.text.endswith("</tool_call>")


def test_a_call_cut_by_max_tokens_is_left_out(qwen3):
    params = SamplingParams(max_tokens=12, temperature=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = qwen3.chat(ASK, params, tools=[WEATHER], tool_choice=named, chat_template_kwargs=OFF)[0]
    assert out.finish_reason == "length" and out.tool_calls == []
    assert any("ended inside a call of get_weather" in w for w in out.warnings), out.warnings


def test_no_tools_no_grammar_and_a_schema_holds_the_answer(qwen3):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = SamplingParams(
        max_tokens=24, temperature=0, structured=StructuredOutput(json_schema=schema)
    )
    out = qwen3.chat(ASK, params, chat_template_kwargs=OFF)[0]
    assert out.tool_calls == [] and out.reasoning_text is None
    assert out.finish_reason == "stop" and out.validated is True, out.warnings
    jsonschema.validate(json.loads(out.content), schema)


def test_a_prompt_that_opens_thinking_splits_it_out(r1):
    assert (r1.dialect.tools, r1.dialect.reasoning) == ("deepseek_r1", "deepseek_r1")
    out = r1.chat(ASK, SamplingParams(max_tokens=8, temperature=0), tools=[WEATHER])[0]
    # the block the prompt opened never closed within 8 tokens: all of it is thinking
    assert out.finish_reason == "length" and out.tool_calls == []
    assert out.reasoning_text == out.text.strip() and out.content is None


def test_an_unknown_dialect_fails_at_start_with_the_list(loaded_model):
    with pytest.raises(ValueError, match=r"tool_call_format: unknown dialect 'qwen3'.*qwen_3"):
        LLM(loaded=loaded_model, kv_cache_memory=32 << 20, tool_call_format="qwen3")


@pytest.fixture(scope="module")
def r1(tmp_path_factory, loaded_model):
    with served(DEEPSEEK_R1, tmp_path_factory.mktemp("r1"), loaded_model) as llm:
        yield llm


@pytest.mark.parametrize("budget", [0, 5])
def test_thinking_ends_at_its_budget_then_the_calls_follow(r1, budget):
    params = SamplingParams(max_tokens=160, temperature=0, thinking_token_budget=budget)
    out = r1.chat(ASK, params, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)[
        0
    ]
    close = r1.tokenizer.encode("</think>", add_special_tokens=False)
    assert out.token_ids[budget : budget + len(close)] == close  # written for it at the budget
    assert out.finish_reason == "stop", out.warnings
    assert [c.name for c in out.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(out.tool_calls[0].arguments), WEATHER["function"]["parameters"])
    assert out.reasoning_text == (out.text.split("</think>")[0].strip() or None)


def test_a_budget_past_any_context_is_refused_by_name():
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=10**9)


def test_a_forced_close_leaves_the_rest_of_the_batch_alone(r1):
    """The budget masks its own row only: a victim's tokens are the same beside it."""
    victim = [{"role": "user", "content": "Tell me about Oslo."}]
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = r1.chat(victim, plain)[0]
    budget = SamplingParams(max_tokens=12, temperature=0, thinking_token_budget=0)
    both = r1.chat([victim, ASK], [plain, budget])
    assert both[0].token_ids == alone.token_ids
    close = r1.tokenizer.encode("</think>", add_special_tokens=False)
    assert both[1].token_ids[: len(close)] == close


@pytest.mark.parametrize(
    ("family", "template", "dialect"),
    [("llama", LLAMA31, "llama"), ("qwen3", QWEN3_CODER, "qwen_3_coder")],
)
def test_other_families_call_in_their_own_format(
    tmp_path_factory, loaded_model, family, template, dialect
):
    root = tmp_path_factory.mktemp(dialect)
    with served(template, root, loaded_model, family) as llm:
        assert llm.dialect.tools == dialect and llm.dialect.reasoning == "none"
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named):
            params = SamplingParams(max_tokens=96, temperature=0)
            out = llm.chat(
                ASK, params, tools=[WEATHER, NOW], tool_choice=choice, parallel_tool_calls=False
            )[0]
            assert out.finish_reason == "stop" and out.reasoning_text is None, out.warnings
            assert len(out.tool_calls) == 1 and out.validated is True, out.warnings
            if choice is named:
                assert out.tool_calls[0].name == "get_weather"


def test_harmony_calls_are_addressed_to_functions_and_parsed(tmp_path_factory, loaded_model):
    with served(HARMONY, tmp_path_factory.mktemp("harmony"), loaded_model) as llm:
        assert (llm.dialect.tools, llm.dialect.reasoning) == ("harmony", "harmony")
        params = SamplingParams(max_tokens=96, temperature=0, thinking_token_budget=4)
        out = llm.chat(
            ASK, params, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
        )[0]
        assert out.finish_reason == "stop", out.warnings
        assert [c.name for c in out.tool_calls] == ["get_weather"] and out.validated is True
        assert "to=functions.get_weather" in out.text  # one of harmony's addressings


@pytest.mark.parametrize("form", ["text", "json_object"])
def test_a_response_format_in_any_form_follows_the_thinking(r1, form):
    """A schema sent as JSON text, or `json_object`, holds the answer after the block the
    prompt opened, never from the first token (which would leave no room to think)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    so = StructuredOutput(json_schema=json.dumps(schema), max_whitespace_cnt=1)
    if form == "json_object":
        so = StructuredOutput(json_object=True, max_whitespace_cnt=1)
    params = SamplingParams(max_tokens=64, temperature=0, thinking_token_budget=3, structured=so)
    out = r1.chat(ASK, params)[0]
    close = r1.tokenizer.encode("</think>", add_special_tokens=False)
    assert out.token_ids[3 : 3 + len(close)] == close and out.reasoning_text
    assert out.finish_reason == "stop" and out.validated is True, out.warnings
    jsonschema.validate(json.loads(out.content), schema if form == "text" else {"type": "object"})
