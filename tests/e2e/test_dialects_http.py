"""A thinking model's dialect over HTTP, through the real `openai` client: a random-weight model
with a DeepSeek-R1 chat template (its generation prompt opens the thinking block), served as a
second application beside the main one. Thinking comes back as `reasoning_content` (and
`reasoning`), calls in the family's format as `tool_calls`, streamed == whole, the budget ends
the thinking, and hostile values beside a victim change nothing else."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest
import redis
from e2e_support import KEY_A, redis_url, small_config, wait_healthy
from transformers import AutoTokenizer

from deployments.service_config import GrammarServiceConfig, IngressConfig, TenantConfig
from deployments.tenants import digest
from tests.chat_templates import DEEPSEEK_R1
from tests.families import build

MODEL = "r1-random"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def r1(proxy, tmp_path_factory, loaded_model):
    """The second application, at /r1: the main one's settings, a DeepSeek-R1 template."""
    from deployments.app import build_app

    base, serve = proxy
    folder = build("qwen3", tmp_path_factory.mktemp("r1"), loaded_model.path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = DEEPSEEK_R1
    tokenizer.save_pretrained(folder)
    redis.Redis.from_url(redis_url(12)).flushdb()
    cfg = small_config(
        model=str(folder),
        served_model_name=MODEL,
        redis_url=redis_url(12),
        ingress=IngressConfig(num_replicas=1, listener="proxy"),  # beside the main app
        grammar=GrammarServiceConfig(workers=1, deadline_s=5.0),
        tenants=[TenantConfig(name="tenant-a", api_key_sha256=[digest(KEY_A)])],
    )
    serve.run(build_app(cfg), name="r1", route_prefix="/r1", blocking=False)
    wait_healthy(f"{base}/r1")
    yield openai.OpenAI(base_url=f"{base}/r1/v1", api_key=KEY_A, max_retries=0, timeout=120)
    serve.delete("r1")


EXTENSIONS = ("thinking_token_budget", "include_reasoning", "chat_template_kwargs")


def chat(client, **kw):
    """A chat completion; vLLM's fields in `extra_body`, as its users send them."""
    extra = {k: kw.pop(k) for k in EXTENSIONS if k in kw}
    kw = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 64, **kw}
    return client.chat.completions.create(extra_body=extra, **kw)


def test_thinking_is_split_out_and_calls_parse(r1):
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    kw |= {"max_tokens": 160}
    out = chat(r1, thinking_token_budget=4, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", out.model_extra["structserve"]
    thinking = choice.message.model_extra["reasoning_content"]
    assert thinking and choice.message.model_extra["reasoning"] == thinking
    assert out.usage.completion_tokens_details.reasoning_tokens > 0
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed = list(chat(r1, thinking_token_budget=4, stream=True, **kw))
    deltas = [c.delta for chunk in streamed for c in chunk.choices]
    said = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    calls = [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or ()]
    assert said == thinking
    assert calls == [(call.function.name, call.function.arguments)]


def test_the_budget_ends_thinking_and_include_reasoning_false_leaves_it_out(r1):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    out = chat(r1, thinking_token_budget=3, response_format=fmt, max_tokens=40)
    message = out.choices[0].message
    assert out.usage.completion_tokens_details.reasoning_tokens <= 4
    assert message.model_extra["reasoning_content"]
    if out.choices[0].finish_reason == "stop":  # a random model may write JSON to the limit
        jsonschema.validate(json.loads(message.content), schema)
    hidden = chat(r1, thinking_token_budget=3, include_reasoning=False, max_tokens=8)
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})


def test_a_streamed_response_has_its_reasoning_item(r1):
    events = list(
        r1.responses.create(
            model=MODEL,
            input="Weather in Oslo?",
            reasoning={"effort": "minimal"},
            max_output_tokens=24,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds
    final = events[-1].response
    said = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == said


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"thinking_token_budget": 10**9}, "thinking_token_budget"),
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ],
)
def test_hostile_values_are_400s_naming_them(r1, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(r1, **kw)
    assert err.value.body["param"].startswith(param), err.value.body


def test_hostile_requests_beside_a_victim_change_nothing(r1):
    """A budget of 0, a template option the template does not read, a 5 MB tool result:
    each answered (or refused) on its own; the victim's tokens are the same as alone."""
    victim = {"messages": [{"role": "user", "content": "Tell me about Oslo."}], "max_tokens": 12}
    alone = chat(r1, **victim).choices[0].message
    result = [
        {"role": "assistant", "content": "", "tool_calls": [_call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x" * (5 << 20)},
    ]
    hostile = [
        {"thinking_token_budget": 0, "tools": TOOLS, "tool_choice": "required", "max_tokens": 160},
        {"chat_template_kwargs": {"not_read_by_the_template": True}},
        {"messages": ASK + result, "max_tokens": 4},
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_attempt, r1, kw) for kw in hostile]
        beside = chat(r1, **victim).choices[0].message
        answers = [f.result() for f in futures]
    assert beside.content == alone.content
    assert beside.model_extra["reasoning_content"] == alone.model_extra["reasoning_content"]
    assert answers[0] == "tool_calls" and answers[1] in ("length", "stop")
    assert answers[2] in (400, 413)  # over the body or prompt cap, by name


def _call() -> dict:
    return {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{}"},
    }


def _attempt(client, kw):
    try:
        return chat(client, **kw).choices[0].finish_reason
    except openai.APIStatusError as exc:
        return exc.status_code
