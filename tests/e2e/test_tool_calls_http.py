"""Tool calling through the real `openai` client against the real server: each `tool_choice`,
streamed calls reassembled, `parse` with a pydantic function tool, a second turn with the
result. Constrained calls must validate every time; what a 135M model chooses is not the test."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from e2e_support import KEY_A
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY_A, max_retries=0, timeout=120)


def create(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=kw.pop("messages", ASK), tools=TOOLS, temperature=0, **kw
    )


def assert_valid_calls(message) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_always_validate(client, parallel):
    out = create(client, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message)
    assert choice.message.content is None
    assert parallel or len(choice.message.tool_calls) == 1
    assert out.model_extra["structserve"]["validated"] == [True]


def test_a_named_function_is_called_once(client):
    named = {"type": "function", "function": {"name": "add"}}
    out = create(client, tool_choice=named, max_tokens=80)
    message = out.choices[0].message
    assert_valid_calls(message)
    assert [c.function.name for c in message.tool_calls] == ["add"]
    assert out.choices[0].finish_reason == "tool_calls"


def test_auto_answers_with_text_or_a_valid_call(client):
    out = create(client, tool_choice="auto", max_tokens=80)
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert_valid_calls(choice.message)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_none_never_calls(client):
    out = create(client, tool_choice="none", max_tokens=20)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content


def test_streamed_calls_reassemble_to_the_whole_answer(client):
    kw = {"tool_choice": "required", "max_tokens": 120}
    whole = create(client, **kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in create(client, stream=True, **kw):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for d in choice.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.id is not None:
                    entry["name"], entry["id"] = d.function.name, d.id
                entry["arguments"] += d.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


class Weather(BaseModel):
    city: str
    unit: str


def test_parse_with_a_pydantic_function_tool(client):
    out = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    parsed = out.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather)


def test_a_second_turn_takes_the_call_and_its_result(client):
    first = create(client, tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    out = create(client, messages=history, tool_choice="none", max_tokens=16)
    assert out.choices[0].message.content
    alone = create(client, tool_choice="none", max_tokens=1)  # the call and result are in
    assert out.usage.prompt_tokens > alone.usage.prompt_tokens + 10


def test_bad_tool_requests_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        create(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"
    bad_history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{"}}
            ],
        },
    ]
    with pytest.raises(openai.BadRequestError, match="arguments: not JSON"):
        create(client, messages=bad_history, max_tokens=4)


def test_response_format_structural_tag(client):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "content": {"type": "json_schema", "json_schema": ADD},
            "end": "</answer>",
        },
    }
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=tag, temperature=0, max_tokens=60
    )
    text = out.choices[0].message.content
    assert text.startswith("<answer>") and text.endswith("</answer>")
    jsonschema.validate(json.loads(text.removeprefix("<answer>").removesuffix("</answer>")), ADD)


def test_loosened_keywords_in_a_function_schema_are_reported(client):
    tags = {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 2}
    loose = {"type": "object", "properties": {"tags": tags}, "required": ["tags"]}
    tool = {"type": "function", "function": {"name": "tag", "parameters": loose, "strict": True}}
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], tool_choice="required", max_tokens=40
    )
    (warnings,) = out.model_extra["structserve"]["warnings"]
    assert any("uniqueItems: not enforced" in w for w in warnings), warnings


def test_a_call_cut_by_max_tokens_is_never_sent(client):
    """The answer ends inside a call: no part of it is sent, whole or streamed, and the
    warnings name it; what came whole before it still validates."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"tool_choice": named, "max_tokens": 20}
    out = create(client, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    warnings = out.model_extra["structserve"]["warnings"][0]
    assert any("the answer ended inside a call" in w for w in warnings), warnings
    streamed = [
        d
        for chunk in create(client, stream=True, **kw)
        for c in chunk.choices
        for d in c.delta.tool_calls or ()
    ]
    assert streamed == []
