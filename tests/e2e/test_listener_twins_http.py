"""The main application answers on its own listener (the default) and, as the plain twin, through
Ray Serve's proxy ("/" routes to it): the same greedy tokens either way, streamed or whole,
constrained or not, with the real `openai` client."""

from __future__ import annotations

import openai
from e2e_support import KEY_A

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {"fruit": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["fruit", "count"],
}


def answers(base: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY_A, max_retries=0, timeout=120)
    ask = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    fruit = [{"role": "user", "content": "Name a fruit and how many you ate."}]
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    whole = client.chat.completions.create(messages=fruit, **ask).choices[0].message.content
    shaped = client.chat.completions.create(messages=fruit, response_format=schema, **ask)
    chunks = client.chat.completions.create(messages=fruit, stream=True, **ask)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return [whole or "", shaped.choices[0].message.content or "", streamed]


def test_the_own_listener_and_rays_proxy_give_the_same_tokens(proxy, server) -> None:
    through_proxy, _ = proxy
    assert server != through_proxy  # two ways in to one application
    own = answers(server)
    assert own == answers(through_proxy)
    assert own[0] == own[2] and own[1].startswith("{")
