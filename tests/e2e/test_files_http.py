"""OpenAI's Files API with the real `openai` client: upload (multipart, as the client sends
it), list, retrieve, read and delete a tenant's own JSONL; another tenant's id is a 404 for
every verb; a file that is not JSONL, a wrong purpose and an upload over the cap are 4xx naming
the field, while a victim's stream goes on."""

from __future__ import annotations

import json

import openai
import pytest
from e2e_support import KEY_A, KEY_B

MODEL = "SmolLM2-135M-Instruct"


def client(server: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=120)


def jsonl(n: int) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(n)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def test_a_tenants_files_round_trip_and_are_its_own(server):
    a, b = client(server, KEY_A), client(server, KEY_B)
    data = jsonl(3)
    made = a.files.create(file=("lines.jsonl", data), purpose="batch")
    assert made.bytes == len(data) and made.purpose == "batch" and made.filename == "lines.jsonl"
    assert made.id in [f.id for f in a.files.list()]
    assert made.id not in [f.id for f in b.files.list()]
    assert a.files.retrieve(made.id).bytes == len(data)
    assert a.files.content(made.id).read() == data
    for verb in (b.files.retrieve, b.files.content, b.files.delete):
        with pytest.raises(openai.NotFoundError):
            verb(made.id)
    assert a.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(made.id)


def test_bad_uploads_name_their_field_beside_a_victim(server):
    a, b = client(server, KEY_A), client(server, KEY_B)
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    expected = a.chat.completions.create(**ask).choices[0].message.content
    before = {f.id for f in b.files.list()}
    victim = a.chat.completions.create(**ask, stream=True)
    first = next(iter(victim))
    with pytest.raises(openai.BadRequestError) as err:
        b.files.create(file=("x.jsonl", b"not json\n"), purpose="batch")
    assert err.value.body["param"] == "file" and "not JSONL" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        b.files.create(file=("x.jsonl", jsonl(1)), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as err:
        b.files.create(file=("big.jsonl", jsonl(1) * 20_000), purpose="batch")  # ~3 MB > 1 MiB
    assert err.value.status_code == 413
    rest = "".join(c.choices[0].delta.content or "" for c in victim if c.choices)
    assert (first.choices[0].delta.content or "") + rest == expected
    assert {f.id for f in b.files.list()} == before  # nothing was kept
