"""Tool calls: the constraint each `tool_choice` builds (checked with real xgrammar on the real
tokenizer), the parser over whole and streamed text, and the fallback prompt."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr

from deployments import tools
from deployments.protocol import ChatCompletionRequest
from deployments.translate import sampling_from
from services.dialects import tag_for
from services.engine import tool_format

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
WEATHER = tool_format.render_call("get_weather", {"city": "Paris"})
NOW = tool_format.render_call("now", {})


def body(**kw) -> ChatCompletionRequest:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    return ChatCompletionRequest.model_validate({**base, **kw})


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info), tokenizer.eos_token_id


def accepts(compiler, tag, text: str) -> bool:
    """Whether the grammar takes exactly `text` and then the end of the answer."""
    c, eos = compiler
    m = xgr.GrammarMatcher(c.compile_structural_tag(json.dumps(tag)))
    return (m.accept_string(text) if text else True) and m.accept_token(eos)


CASES = [  # tool_choice, parallel, text, accepted
    ("auto", True, "Just text.", True),
    ("auto", True, "Let me look. " + WEATHER, True),
    ("auto", True, WEATHER + "\n" + NOW, True),
    ("auto", False, WEATHER + "\n" + NOW, False),
    ("auto", True, WEATHER.replace('"Paris"', "7"), False),  # arguments follow the schema
    ("required", True, "Just text.", False),
    ("required", True, WEATHER + "\n" + NOW, True),
    ("required", False, WEATHER + "\n" + NOW, False),
    ("required", False, "", False),
    ({"type": "function", "function": {"name": "now"}}, True, NOW, True),
    ({"type": "function", "function": {"name": "now"}}, True, WEATHER, False),
    ({"type": "function", "function": {"name": "now"}}, True, NOW + "\n" + NOW, False),
]


@pytest.mark.parametrize(("choice", "parallel", "text", "ok"), CASES)
def test_each_tool_choice_constrains_as_documented(compiler, choice, parallel, text, ok):
    tag = tools.structural_tag(body(tool_choice=choice, parallel_tool_calls=parallel))
    assert accepts(compiler, tag, text) is ok


def test_none_constrains_nothing_and_hides_the_tools():
    b = body(tool_choice="none")
    assert tools.structural_tag(b) is None and tools.prompt_tools(b) is None
    assert sampling_from(b, 64).structured is None


def test_tools_and_another_constraint_is_a_400_naming_both():
    from deployments.protocol import BadRequest

    b = body(tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(BadRequest, match="tools, response_format"):
        sampling_from(b, 64)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no function"),
        ({"tools": TOOLS + TOOLS[:1]}, "share a name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "pattern"),
        ({"tools": None, "tool_choice": "required"}, "no tools"),
    ],
)
def test_bad_tool_requests_are_refused(kw, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        body(**kw)


NAMES = ["get_weather", "now"]


def reader(choice="auto") -> tools.AnswerReader:
    """What the ingress reads a Hermes-dialect answer with (the replica's tag for it)."""
    return tools.AnswerReader(tag_for("hermes", TOOLS, choice, True), NAMES)


def parse(text: str, choice="auto"):
    r = reader(choice)
    r.feed(text)
    return r.result()


def test_whole_text_parses_into_content_and_calls():
    content, calls = parse("Sure. " + WEATHER + "\n" + NOW)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert len({c.id for c in calls}) == 2
    assert tools.finish_reason("stop", calls) == "tool_calls"
    assert tools.finish_reason("length", calls) == "length"
    assert parse("no calls here, just text")[1] == []


def test_streamed_deltas_reassemble_to_the_whole_in_any_chunking():
    text = "Ok. " + WEATHER.replace("Paris", 'Pa}\\n\\"ris </tool_call>') + "\n" + NOW
    _, whole = parse(text)
    assert len(whole) == 2
    rng = random.Random(0)
    for _ in range(100):
        r, deltas, i = reader(), [], 0
        while i < len(text):
            k = rng.randint(1, 9)
            deltas += r.feed(text[i : i + k])
            i += k
        deltas += r.finish()
        content = "".join(d.get("content", "") for d in deltas)
        sent = [e for d in deltas for e in d.get("tool_calls", ())]
        assert content == "Ok."
        assert [(e["function"]["name"], e["function"]["arguments"]) for e in sent] == [
            (c.name, c.arguments) for c in whole
        ]


def test_a_repeated_call_ends_the_answer_and_is_dropped():
    r = reader()
    first = r.feed(WEATHER + "\n")
    again = r.feed(WEATHER + "\n" + WEATHER)
    assert first and not again  # the repeat was held back, never sent
    assert r.repeated and len(r.calls) == 1
    other = reader()
    other.feed(WEATHER + "\n" + tool_format.render_call("get_weather", {"city": "Rome"}))
    assert not other.repeated and len(other.calls) == 2


class _Stream:
    """A replica's stream of one choice (the deltas after the first)."""

    def __init__(self, *deltas) -> None:
        self.deltas, self.cancelled = list(deltas), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return self.deltas.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("streamed", [False, True])
def test_a_repeat_in_the_delta_that_reached_max_tokens_still_ends_the_answer(streamed):
    """The engine can run past a repeated call to max_tokens within one delta (drafts give
    several tokens a step): the answer ended at the repeat, whole, so it reads `tool_calls`,
    not `length` (which a client's `parse` refuses)."""
    import asyncio

    from deployments import answers
    from deployments.observe import RequestObs
    from deployments.wire import Delta, Split
    from services.telemetry import Telemetry, TelemetrySettings

    tel = Telemetry(TelemetrySettings(), "test")
    req = body(tool_choice="required", stream=streamed)
    first = Delta(answer=Split(tag_for("hermes", TOOLS, "required", True), NAMES, None))
    text = WEATHER + "\n" + WEATHER + "\n"
    end = Delta(text, 40, True, "length", completion_tokens=40)

    async def run():
        obs = RequestObs(tel, "chat", {})
        if not streamed:
            return await answers.collect(obs, req, "r", True, [_Stream(end)], [first])

        async def release(_tokens: int) -> None:
            return None

        events = answers.sse(obs, req, "r", True, [_Stream(end)], [first], release)
        return [json.loads(e[6:]) async for e in events if e.startswith("data: {")]

    out = asyncio.run(run())
    tel.shutdown()
    if streamed:
        deltas = [c for e in out for c in e["choices"]]
        calls = [t for c in deltas for t in c["delta"].get("tool_calls", [])]
        reasons = [c["finish_reason"] for c in deltas if c.get("finish_reason")]
    else:
        calls = out["choices"][0]["message"]["tool_calls"]
        reasons = [out["choices"][0]["finish_reason"]]
    assert len(calls) == 1 and reasons == ["tool_calls"]


def test_a_template_without_tools_gets_them_in_a_system_prompt(tokenizer):
    assert not tool_format.template_takes_tools(tokenizer)  # SmolLM2's
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    out = tool_format.fallback_messages(history, TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"].endswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": WEATHER}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_strict_fidelity_reports_loosened_keywords_inside_tool_arguments():
    from services.grammar.fidelity import loosened_in_tag

    tools_ = [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]
    tag = tools.structural_tag(body(tools=tools_, tool_choice="required"))
    (finding,) = loosened_in_tag(tag)
    assert finding.endswith("/json_schema/not: not enforced")


def test_a_template_that_takes_tools_gets_them_as_they_are(tokenizer):
    """A template that reads `tools` renders them itself: no system prompt of ours."""
    import copy

    from services.engine.chat_template import ChatRenderer

    native = copy.deepcopy(tokenizer)
    native.chat_template = (
        "{% for t in tools %}<tool>{{ t.function.name }}</tool>{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    hi = [{"role": "user", "content": "hi"}]
    text = native.decode(ChatRenderer(native, workers=0).ids(hi, 10_000, tools=TOOLS))
    assert text.startswith("<tool>get_weather</tool><tool>now</tool>user: hi")
    assert "<tools>" not in text
    fallback = tokenizer.decode(ChatRenderer(tokenizer, workers=0).ids(hi, 10_000, tools=TOOLS))
    assert "<tools>" in fallback and '"name": "get_weather"' in fallback


def test_a_call_the_answer_ended_inside_is_never_sent():
    """`max_tokens` cut the second call: the first comes out whole, the cut one not at all,
    streamed or whole, and it is named in the warnings."""
    text = WEATHER + "\n" + tool_format.call_begin("get_weather") + '{"city": "Os'
    content, calls = parse(text, "required")
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    r, deltas = reader("required"), []
    for ch in text:
        deltas += r.feed(ch)
    deltas += r.finish()
    sent = [e for d in deltas for e in d.get("tool_calls", ())]
    assert {e["index"] for e in sent} == {0}  # nothing of the cut call, not even its name
    assert "".join(e["function"]["arguments"] for e in sent) == '{"city": "Paris"}'
    assert r.cut == ["get_weather"]
    assert "ended inside a call of get_weather" in tools.cut_warnings(r)[0]


def test_an_answer_ended_inside_a_calls_head_has_no_call_and_no_head_text():
    content, calls = parse("Sure. " + tool_format.call_begin("get_weather")[:20])
    assert content == "Sure." and calls == []
    r = reader()
    r.feed(tool_format.TRIGGER + '\n{"na')
    assert r.finish() == [] and r.content == ""


def test_a_call_is_sent_only_once_whole():
    r = reader()
    head = r.feed(WEATHER[: len(WEATHER) - 20])
    assert not [d for d in head if "tool_calls" in d]  # its head and arguments so far held
    rest = r.feed(WEATHER[len(WEATHER) - 20 :])
    assert [e["function"]["name"] for d in rest for e in d.get("tool_calls", ())] == ["get_weather"]


def test_thinking_is_split_out_and_can_be_left_out():
    """A Qwen3-dialect answer: thinking as `reasoning_content` (and `reasoning`), the call whole;
    with include_reasoning off, the thinking is not sent."""
    tag = tag_for("qwen_3", TOOLS, "auto", True, "enabled")
    text = "Oslo, so a call.</think>\n\n" + WEATHER
    for shown in (True, False):
        r = tools.AnswerReader(tag, NAMES, reasoning=shown)
        deltas = [d for ch in text for d in r.feed(ch, 1)] + r.finish()
        said = "".join(d.get("reasoning_content", "") for d in deltas)
        assert said == ("Oslo, so a call." if shown else "")
        assert r.thinking == "Oslo, so a call." and 0 < r.thinking_tokens < len(text)
        assert [c.name for c in r.calls] == ["get_weather"] and r.content == ""


def test_an_output_that_opens_thinking_twice_is_split_cleanly():
    """A model (unconstrained: no tools, no schema) writes the opening marker again inside its
    thinking and after it: one reasoning, the rest content, streamed == whole."""
    tag = tag_for("qwen_3", [], "auto", True, "auto")
    text = "<think>a <think> b</think>\n\nc <think> d</think> e"
    whole = tools.AnswerReader(tag, [])
    whole.feed(text)
    content, calls = whole.result()
    r = tools.AnswerReader(tag, [])
    deltas = [d for ch in text for d in r.feed(ch)] + r.finish()
    assert calls == [] and whole.thinking and content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.thinking
    assert "".join(d.get("content", "") for d in deltas) == content
