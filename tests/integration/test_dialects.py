"""Dialects (services/dialects): an answer in each family's format, which the dialect's own
grammar accepts (real xgrammar on the real tokenizer), splits back into reasoning, content and
calls by walking that grammar; streamed in pieces of any size, the deltas concatenate to the
whole split; a call cut by the end of the text is never a call."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr

from services.dialects import DIALECTS, Splitter, check, detect, split, tag_for

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
NAMES = ["get_weather", "now"]
OSLO = {"city": "Oslo", "days": 3}

# dialect: (an answer in its format, reasoning, content) with the calls get_weather(OSLO), now()
ANSWERS = {
    "hermes": (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 3}}\n</tool_call><tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "",
        "Let me check.",
    ),
    "qwen_3": (
        'I should look.</think>\n\nLet me check.<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo", "days": 3}}\n</tool_call><tool_call>\n{"name": "now", '
        '"arguments": {}}\n</tool_call>',
        "I should look.",
        "Let me check.",
    ),
    "llama": ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}', "", ""),
    "deepseek_r1": (
        "Hmm.</think>Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Oslo", "days": 3}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        "Hmm.",
        "Sure",
    ),
    "harmony": (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather<|constrain|>json<|message|>{"city": "Oslo", "days": 3}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.now<|constrain|>json<|message|>{}"
        "<|call|>",
        "Think.",
        "",
    ),
    "qwen_3_coder": (
        "Plan.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<function=now>\n\n</function>\n</tool_call>",
        "Plan.",
        "",
    ),
    "glm_4_7": (
        "Plan.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>now</tool_call>",
        "Plan.",
        "",
    ),
}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer)), tokenizer


def tag(dialect: str) -> dict:
    return tag_for(dialect, [WEATHER, NOW], "auto", parallel=True, reasoning="enabled")


def accepted(compiler, structural_tag: dict, text: str) -> bool:
    comp, tokenizer = compiler
    matcher = xgr.GrammarMatcher(comp.compile_structural_tag(json.dumps(structural_tag)))
    if not matcher.accept_string(text):
        return False
    return matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


@pytest.mark.parametrize("dialect", list(ANSWERS))
def test_an_answer_splits_back_by_its_own_grammar(compiler, dialect):
    text, reasoning, content = ANSWERS[dialect]
    assert accepted(compiler, tag(dialect), text)  # what the grammar lets a model write
    answer = split(tag(dialect), text, NAMES)
    assert (answer.reasoning, answer.content, answer.cut) == (reasoning, content, [])
    calls = [(c.name, json.loads(c.arguments)) for c in answer.calls]
    want = [("get_weather", OSLO), ("now", {})]
    assert calls == (want[:1] if dialect == "llama" else want)


@pytest.mark.parametrize("dialect", list(ANSWERS))
def test_streamed_pieces_concatenate_to_the_whole(dialect):
    text = ANSWERS[dialect][0]
    whole = split(tag(dialect), text, NAMES)
    rng = random.Random(dialect)
    for _ in range(3):
        splitter, reasoning, content, calls = Splitter(tag(dialect), NAMES), "", "", []
        at = 0
        while at < len(text):
            step = rng.randint(1, 7)
            new = splitter.feed(text[at : at + step])
            reasoning, content, calls = (
                reasoning + new.reasoning,
                content + new.content,
                calls + new.calls,
            )
            at += step
        new = splitter.finish()
        reasoning, content, calls = (
            reasoning + new.reasoning,
            content + new.content,
            calls + new.calls,
        )
        assert (reasoning, content, calls) == (whole.reasoning, whole.content, whole.calls)


@pytest.mark.parametrize("dialect", list(ANSWERS))
def test_a_call_cut_by_the_end_of_the_text_is_never_a_call(dialect):
    text = ANSWERS[dialect][0]
    marker = '"days": 3' if "json" in text or "{" in text else "<arg_key>days"
    marker = marker if marker in text else "Oslo"
    cut_text = text[: text.index(marker) + 4]  # inside get_weather's arguments
    whole = split(tag(dialect), cut_text, NAMES)
    assert whole.calls == [] and whole.cut == ["get_weather"]
    splitter = Splitter(tag(dialect), NAMES)
    streamed = [c for ch in cut_text for c in splitter.feed(ch).calls] + splitter.finish().calls
    assert streamed == []


def test_the_dialect_is_detected_from_the_chat_template():
    assert detect("{{ '<|channel|>analysis' }}")[0] == "harmony"
    assert detect("<tool_call>{{ tool_call | tojson }}</tool_call><think>")[0] == "qwen_3"
    assert detect("<tool_call>\n<function={{ name }}>\n<parameter=")[0] == "qwen_3_coder"
    assert detect("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>")[0] == (
        "deepseek_r1"
    )
    name, why = detect("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert name == "hermes" and "system prompt" in why


def test_an_unknown_dialect_is_refused_with_the_list():
    assert check("qwen_3") == "qwen_3"
    with pytest.raises(ValueError, match="unknown dialect 'qwen3'") as err:
        check("qwen3")
    assert all(name in str(err.value) for name in DIALECTS)


def test_each_calls_arguments_are_validated_strict_or_not():
    """A non-strict tool's arguments are not held to its schema by the grammar (xgrammar's
    builtin tags leave them any JSON object), so they are validated after: `validated` says
    whether every call passed, `warnings` which did not and why."""
    from services.engine.chat import Turn, read
    from services.engine.params import RequestOutput, SamplingParams

    loose = {**WEATHER, "function": {**WEATHER["function"], "strict": False}}
    tag_ = tag_for("hermes", [loose], "auto")
    schema = WEATHER["function"]["parameters"]
    turn = Turn([], SamplingParams(), tag_, None, {"get_weather": schema})
    for args, ok in (('{"city": "Oslo"}', True), ('{"town": "Oslo"}', False)):
        text = '<tool_call>\n{"name": "get_weather", "arguments": ' + args + "}\n</tool_call>"
        out = read(turn, RequestOutput("r", [], text, [], True, "stop"))
        assert [c.arguments for c in out.tool_calls] == [args]
        assert out.validated is ok
        assert ok or any(w.startswith("tool_calls[get_weather]:") for w in out.warnings)
