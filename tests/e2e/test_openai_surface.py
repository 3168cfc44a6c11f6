"""The OpenAI surface with the real `openai` client: log-probabilities (whole and streamed),
sampling controls, vLLM's and SGLang's names for constraints, fields refused by name, max_tokens
left to the context, chat template options."""

from __future__ import annotations

import json
import re

import openai
import pytest
import requests
from e2e_support import KEY_A, KEY_FUZZ

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY_A, max_retries=0, timeout=120)


def test_chat_logprobs_with_top_alternatives(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_streamed_logprobs_add_up_to_the_whole(client):
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        e
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for e in choice.logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in whole
    ]


def test_completion_logprobs_and_prompt_logprobs(client):
    out = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"prompt_logprobs": 0},
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == choice.text
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    prompt = choice.model_extra["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == out.usage.prompt_tokens
    assert all(v["logprob"] <= 0 for entry in prompt[1:] for v in entry.values())


def test_logit_bias_forbids_a_token_and_penalties_break_a_loop(client, tokenizer):
    kwargs = {"model": MODEL, "prompt": "one one one one one one", "max_tokens": 6}
    plain = client.completions.create(temperature=0, **kwargs).choices[0].text
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = client.completions.create(temperature=0, logit_bias={str(first): -100}, **kwargs)
    assert not banned.choices[0].text.startswith(tokenizer.decode([first]))
    penalized = client.completions.create(
        temperature=0, frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5}, **kwargs
    )
    assert len(set(penalized.choices[0].text.split())) > len(set(plain.split()))


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_choice": ["apple", "pear"]},
        {"structured_outputs": {"choice": ["apple", "pear"]}},
        {"regex": "(apple|pear)"},
    ],
)
def test_older_names_for_a_constraint_are_honoured(client, extra):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, temperature=0, extra_body=extra
    )
    assert out.choices[0].message.content in ("apple", "pear")


def test_a_field_the_server_does_not_honour_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, extra_body={"best_of": 3}
        )
    assert "best_of" in err.value.body["message"]
    ok = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=2, user="someone", metadata={"k": "v"}, store=False
    )
    assert ok.choices[0].message.content is not None


def test_max_tokens_unset_runs_to_the_tenant_cap_not_256(server):
    fuzz = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY_FUZZ, max_retries=0, timeout=120)
    out = fuzz.completions.create(model=MODEL, prompt="Once upon", extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"


def test_continue_final_message_continues_the_assistant(client):
    start = "The capital of France is"
    out = client.chat.completions.create(
        model=MODEL,
        messages=[*ASK, {"role": "assistant", "content": start}],
        max_tokens=4,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    fresh = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert out.choices[0].message.content != fresh.choices[0].message.content


def test_an_unknown_model_is_a_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_x_request_id_is_echoed_and_names_the_response(server):
    r = requests.post(
        f"{server}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY_A}", "X-Request-Id": "trace-42"},
        json={"model": MODEL, "messages": ASK, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "chatcmpl-trace-42"
    again = requests.post(  # the same id twice: both answered
        f"{server}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY_A}", "X-Request-Id": "trace-42"},
        json={"model": MODEL, "messages": ASK, "max_tokens": 2},
        timeout=60,
    )
    assert again.status_code == 200


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    auth = {"Authorization": f"Bearer {KEY_A}"}
    r = requests.post(
        f"{server}/tokenize", headers=auth, json={"model": MODEL, "prompt": "Hello world"}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    chat = requests.post(f"{server}/tokenize", headers=auth, json={"model": MODEL, "messages": ASK})
    assert chat.json()["count"] > out["count"]  # the template's tokens
    back = requests.post(
        f"{server}/detokenize", headers=auth, json={"model": MODEL, "tokens": out["tokens"]}
    )
    assert back.json() == {"prompt": "Hello world"}
    bad = requests.post(
        f"{server}/detokenize", headers=auth, json={"model": MODEL, "tokens": [10**9]}
    )
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


def test_unknown_routes_and_methods_answer_in_the_openai_shape(server):
    missing = requests.get(f"{server}/v1/nothing", timeout=30)
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    wrong = requests.get(f"{server}/v1/chat/completions", timeout=30)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert requests.get(f"{server}/health", timeout=30).status_code == 200


def test_structured_outputs_can_pin_the_llguidance_backend(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for so in ({"regex": "[0-9]{3}"}, {"json": schema}):
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=24,
            temperature=0,
            extra_body={
                "structured_outputs": {
                    **so,
                    "backend": "llguidance",
                    "disable_any_whitespace": True,
                }
            },
        )
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop", (so, text)
        if "regex" in so:
            assert re.fullmatch("[0-9]{3}", text), text
        else:
            assert isinstance(json.loads(text)["ok"], bool), text
    # OpenAI's response_format, with the backend pinned by a structured_outputs of options only
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}},
        extra_body={
            "structured_outputs": {"backend": "llguidance", "disable_any_whitespace": True}
        },
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "a", "backend": "outlines"}},
        )
    assert "backend" in str(err.value.body)
