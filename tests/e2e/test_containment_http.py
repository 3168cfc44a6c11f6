"""Containment through the real server: each hostile request of the corpus from one tenant while
another tenant streams; after each, `/healthz` stays 200 and the other stream completes. Then a
property-based fuzz of every operation's body against the ingress's own OpenAPI document: no 5xx,
no hang (`scripts/fuzz-http.sh` runs it longer)."""

from __future__ import annotations

import copy
import os
import threading

import openai
import pytest
import requests
import schemathesis
from e2e_support import KEY_A, KEY_B, KEY_FUZZ
from hostile import CASES, Case
from hypothesis import HealthCheck, given, settings

MODEL = "SmolLM2-135M-Instruct"
FUZZ_EXAMPLES = int(os.environ.get("STRUCTSERVE_FUZZ_EXAMPLES", "12"))
VICTIM_TOKENS = 24


class Victim(threading.Thread):
    """Tenant A's stream, running while tenant B sends the hostile request."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(
            base_url=f"{base}/v1", api_key=KEY_A, max_retries=0, timeout=120
        )
        self.started = threading.Event()
        self.text, self.finish, self.usage, self.error = "", None, None, None

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me about lighthouses."}],
                max_tokens=VICTIM_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.started.set()
                if chunk.usage is not None:
                    self.usage = chunk.usage
                for choice in chunk.choices:
                    self.text += choice.delta.content or ""
                    self.finish = choice.finish_reason or self.finish
        except Exception as exc:  # the assertion below reports it
            self.error = exc
        finally:
            self.started.set()


def hostile_body(case: Case) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Is the sky blue? Answer briefly."}],
        "max_tokens": 32,
        "temperature": 0,
    }
    return {**body, **(case.http or {})}


@pytest.mark.parametrize("case", [c for c in CASES if c.http is not None], ids=lambda c: c.name)
def test_a_hostile_request_hurts_no_other_tenant(server, case):
    victim = Victim(server)
    victim.start()
    assert victim.started.wait(120)
    r = requests.post(
        f"{server}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY_B}"},
        json=hostile_body(case),
        timeout=120,
    )
    victim.join(180)
    assert not victim.is_alive(), "the other tenant's stream did not finish"
    assert victim.error is None, victim.error
    assert victim.finish == "length" and victim.usage.completion_tokens == VICTIM_TOKENS
    assert requests.get(f"{server}/healthz", timeout=30).status_code == 200
    assert r.status_code < 500, r.text
    if case.expect is None:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), r.json()["structserve"]
        if case.validated is not None:
            assert r.json()["structserve"]["validated"] == [case.validated], r.json()
    elif r.status_code == 200:  # failed after its first token: an honest ending, the reason
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "error"
        assert any(case.expect in w for w in out["structserve"]["warnings"][0]), out
    else:
        assert 400 <= r.status_code < 500, r.text
        assert case.expect in r.json()["error"]["message"], r.json()


def test_a_stream_that_ends_in_an_error_says_so_in_its_last_chunk(server):
    """An output that fails validation: `finish_reason` "error" and the verdict in the stream."""
    from hostile import UNRESOLVABLE

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY_B, max_retries=0, timeout=120)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": UNRESOLVABLE}}
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
            max_tokens=32,
            temperature=0,
            stream=True,
            response_format=schema,
        )
    )
    last = next(c for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    assert last.choices[0].finish_reason == "error"
    extra = last.model_extra["structserve"]
    assert extra["validated"] is False
    assert any("schema could not be used to validate" in w for w in extra["warnings"])


# -- property-based fuzz of the bodies, against the service's OpenAPI document -------------------
# (strategies per operation rather than schemathesis' pytest plugin, which pytest 9 breaks)


def _operations() -> list:
    from schemathesis.config import SchemathesisConfig

    from deployments.ingress import app

    config = SchemathesisConfig.from_dict({"generation": {"mode": "all", "deterministic": True}})
    doc = copy.deepcopy(app.openapi())
    for body in doc["components"]["schemas"].values():  # valid bodies name the served model
        if "model" in body.get("properties", {}):
            body["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    schema = schemathesis.openapi.from_dict(doc, config=config)
    return [result.ok() for result in schema.get_all_operations()]


OPERATIONS = _operations()


@pytest.mark.timeout(60 + 30 * FUZZ_EXAMPLES)  # bounded in time too: a hang fails, never waits
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_fuzzed_requests_never_get_a_server_error_or_hang(server, operation):
    headers = {"Authorization": f"Bearer {KEY_FUZZ}"}

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(operation.as_strategy())
    def fuzz(case) -> None:
        response = case.call(base_url=server, headers=headers, timeout=60)  # a hang: it raises
        assert response.status_code < 500, (case.path, case.body, response.text[:300])

    fuzz()
