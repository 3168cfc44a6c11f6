"""OpenAI's Batch API with the real `openai` client, its documented flow unchanged:
`files.create` -> `batches.create` -> poll `batches.retrieve` -> `files.content`. Outputs parse,
a schema-constrained line validates, lines that cannot run are in the error file with their line
and reason, every custom_id is in exactly one file once; another tenant's batch and file are 404s;
a cancel stops new lines and keeps the finished ones."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from e2e_support import KEY_A, KEY_B

MODEL = "SmolLM2-135M-Instruct"
URL = "/v1/chat/completions"
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 10}},
    "required": ["colour"],
    "additionalProperties": False,
}


def client(server: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=120)


def chat_line(cid: str, content: str, max_tokens: int = 4, **body) -> dict:
    messages = [{"role": "user", "content": content}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **body}
    return {"custom_id": cid, "method": "POST", "url": URL, "body": body}


def upload(c: openai.OpenAI, lines: list) -> str:
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    return c.files.create(file=("batch.jsonl", data), purpose="batch").id


def wait(c: openai.OpenAI, batch_id: str, timeout_s: float = 180) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s} s")


def read(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines() if x]


def test_the_documented_flow_runs_unchanged(server):
    a, b = client(server, KEY_A), client(server, KEY_B)
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    lines = [
        chat_line("plain-1", "Say hi."),
        chat_line("plain-2", "Say bye."),
        chat_line("json", "Name a colour as JSON.", max_tokens=40, response_format=fmt),
        {**chat_line("wrong-url", "x"), "url": "/v1/embeddings"},
        "not json",
        chat_line("refused", "x", max_tokens=-1),  # the endpoint's own 400
    ]
    batch = a.batches.create(
        input_file_id=upload(a, lines),
        endpoint=URL,
        completion_window="24h",
        metadata={"job": "e2e"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "e2e"}
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    assert batch.id not in [x.id for x in b.batches.list()]
    done = wait(a, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed) == (6, 3)
    assert done.request_counts.failed == 3
    outputs, errors = read(a, done.output_file_id), read(a, done.error_file_id)
    by_id = {o["custom_id"]: o for o in outputs}
    assert sorted(by_id) == ["json", "plain-1", "plain-2"] and len(outputs) == 3
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    answer = by_id["json"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(answer), SCHEMA)
    why = {e["error"]["line"]: (e["custom_id"], e["error"]["code"]) for e in errors}
    assert why == {
        4: ("wrong-url", "invalid_url"),
        5: (None, "invalid_json"),
        6: ("refused", "http_400"),
    }
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)


def test_another_tenants_file_cannot_start_a_batch(server):
    a, b = client(server, KEY_A), client(server, KEY_B)
    mine = upload(a, [chat_line("x", "hi")])
    with pytest.raises(openai.NotFoundError):
        b.batches.create(input_file_id=mine, endpoint=URL, completion_window="24h")
    with pytest.raises(openai.BadRequestError) as err:
        a.batches.create(input_file_id=mine, endpoint="/v1/embeddings", completion_window="24h")
    assert err.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as err:
        a.batches.create(input_file_id=mine, endpoint=URL, completion_window="1h")
    assert err.value.body["param"] == "completion_window"


def test_cancel_stops_new_lines_and_keeps_the_finished(server):
    a = client(server, KEY_A)
    lines = [chat_line(f"r{i}", f"Count to {i}.", max_tokens=24) for i in range(40)]
    batch = a.batches.create(input_file_id=upload(a, lines), endpoint=URL, completion_window="24h")
    deadline = time.monotonic() + 120
    while a.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    asked = time.monotonic()
    assert a.batches.cancel(batch.id).status == "cancelling"
    done = wait(a, batch.id)
    assert done.status == "cancelled" and time.monotonic() - asked < 30
    ids = [o["custom_id"] for o in read(a, done.output_file_id)]
    assert 2 <= len(ids) < 40 and len(set(ids)) == len(ids)
    assert done.request_counts.completed == len(ids)
