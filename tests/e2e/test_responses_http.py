"""The Responses API through the real `openai` client and an OpenAI Agents SDK agent, against
the real server: text, a schema, a function call round trip, streamed events that add up to
the whole response, and what the API does not do here refused by name."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from e2e_support import KEY_A

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY_A, max_retries=0, timeout=120)


def test_a_text_response(client):
    out = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=12)
    assert out.object == "response" and out.id.startswith("resp-")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text and out.output[0].type == "message"
    assert out.usage.output_tokens == 12 and out.usage.input_tokens > 0


def test_a_schema_holds_the_text(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    out = client.responses.create(
        model=MODEL,
        instructions="Answer in JSON.",
        input="Invent a person.",
        text={"format": fmt},
        temperature=0,
        max_output_tokens=60,
    )
    assert out.status == "completed", out.model_extra["structserve"]
    jsonschema.validate(json.loads(out.output_text), schema)


def test_a_function_call_round_trip(client):
    kw = {"model": MODEL, "tools": [TOOL], "temperature": 0, "max_output_tokens": 60}
    first = client.responses.create(input=ASK, tool_choice="required", **kw)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    second = client.responses.create(input=history, tool_choice="none", **kw)
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]


def test_streamed_events_add_up_to_the_whole_response(client):
    kw = {"model": MODEL, "input": ASK, "tools": [TOOL], "temperature": 0}
    kw |= {"parallel_tool_calls": False}
    whole = client.responses.create(tool_choice="required", max_output_tokens=60, **kw)
    events = list(
        client.responses.create(tool_choice="required", max_output_tokens=60, stream=True, **kw)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    calls = [(i.name, i.arguments) for i in final.output if i.type == "function_call"]
    assert calls == [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == "".join(a for _, a in calls)
    text = client.responses.create(
        model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0, stream=True
    )
    events = list(text)
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"  # completed, or incomplete at 8
    assert said == final.output[0].content[0].text


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": "hi"}] * 10_000}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(client, kw, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**body)
    assert err.value.body["param"].startswith(param), err.value.body


def test_an_agent_calls_a_tool_and_answers(server):
    """An OpenAI Agents SDK agent, unchanged, over the Responses API: it must call the tool
    (tool_choice required on its first turn), gets the result, and answers."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    api = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY_A, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(MODEL, api),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=160
        ),
    )
    result = asyncio.run(Runner.run(agent, ASK, max_turns=4, run_config=RunConfig()))
    assert seen and isinstance(result.final_output, str) and result.final_output
