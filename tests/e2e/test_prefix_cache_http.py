"""Prefix caching over HTTP with the real `openai` client: `usage.prompt_tokens_details` reports
the cached prompt tokens, whole and streamed; another tenant's identical prompt, or another
`cache_salt`, gets no hit; the salt is validated by name; `/metrics` counts queries and hits."""

from __future__ import annotations

import time
import uuid

import openai
import pytest
import requests
from e2e_support import KEY_A, KEY_B, METRICS_TOKEN
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"


def system(tag: str) -> dict[str, str]:
    """A system prompt of ~20 pages no other test sends (the cache outlives tests)."""
    return {"role": "system", "content": f"[{tag}] You extract invoices as JSON. " * 40}


@pytest.fixture(scope="module")
def clients(server) -> tuple[openai.OpenAI, openai.OpenAI]:
    def make(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=120)

    return make(KEY_A), make(KEY_B)


def cached(client: openai.OpenAI, sys: dict[str, str], user: str, **extra) -> int:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[sys, {"role": "user", "content": user}],
        max_tokens=3,
        temperature=0,
        extra_body=extra or None,
    )
    details = out.usage.prompt_tokens_details
    assert details is not None and out.usage.prompt_tokens > 200
    return details.cached_tokens


def test_a_repeated_system_prompt_is_served_from_the_cache(clients):
    a, _ = clients
    sys = system(uuid.uuid4().hex)
    assert cached(a, sys, "ACME, 3 EUR") == 0
    assert cached(a, sys, "Bolt, 9 GBP") >= 200


def test_the_streamed_usage_reports_cached_tokens(clients):
    a, _ = clients
    sys = system(uuid.uuid4().hex)
    cached(a, sys, "first")
    stream = a.chat.completions.create(
        model=MODEL,
        messages=[sys, {"role": "user", "content": "second"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= 200


def test_another_tenant_or_salt_gets_no_hit(clients):
    a, b = clients
    sys = system(uuid.uuid4().hex)
    cached(a, sys, "same question")
    assert cached(b, sys, "same question") == 0  # tenant B: its own pages, never A's
    assert cached(a, sys, "same question", cache_salt="team-1") == 0
    assert cached(a, sys, "same question", cache_salt="team-1") >= 200
    assert cached(a, sys, "same question", cache_salt="team-2") == 0


def test_a_bad_salt_is_a_400_naming_the_field(clients):
    a, _ = clients
    with pytest.raises(openai.BadRequestError) as err:
        cached(a, system("salt"), "hi", cache_salt="x" * 300)
    assert err.value.body["param"] == "cache_salt"


def test_metrics_count_prefix_cache_queries_and_hits(server, clients):
    a, _ = clients
    sys = system(uuid.uuid4().hex)
    cached(a, sys, "one")
    cached(a, sys, "two")
    auth = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    deadline = time.monotonic() + 30  # the replica pushes once a second
    while True:
        text = requests.get(f"{server}/metrics", headers=auth, timeout=30).text
        fams = {f.name: f.samples for f in text_string_to_metric_families(text)}
        hits = [
            s.value
            for s in fams.get("structserve_prefix_cache_hits", [])
            if s.name.endswith("_total") and s.labels.get("tenant") == "tenant-a"
        ]
        if (hits and hits[0] > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert hits and hits[0] >= 200
    assert "structserve_prefix_cache_queries" in fams
    states = {s.labels.get("state") for s in fams.get("structserve_prefix_cache_pages", [])}
    assert states == {"in_use", "evictable"}
