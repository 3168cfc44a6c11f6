"""The trust boundary through the real server, as a hostile tenant tries it with another tenant
streaming beside it: templates are the model's own, a schema cannot freeze a process, bodies are
bounded before any work, every route is metered, every refusal is a 4xx in the OpenAI shape, and
Ray listens on loopback only."""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest
import requests
from e2e_support import KEY_A, KEY_B, KEY_FUZZ, KEY_ONE
from hostile import FREEZER
from test_containment_http import MODEL, VICTIM_TOKENS, Victim

CHAT = [{"role": "user", "content": "Is the sky blue? Answer briefly."}]
SIX_MILLION_HELLOS = {"chat_template": "{{ 'hello ' * 6000000 }}"}
DEEP_JSON_TEXT = '{"a":' * 900 + "1" + "}" * 900


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, **extra}


def tokenize_body(**extra) -> dict:
    return {"model": MODEL, "messages": CHAT, **extra}


KWARGS = "chat_template_kwargs."
# (name, route, body, what the error names): each must be a 400 saying so, before any work
REFUSED = [
    ("own template", "chat", chat_body(chat_template_kwargs=SIX_MILLION_HELLOS), KWARGS),
    ("own template", "tokenize", tokenize_body(chat_template_kwargs=SIX_MILLION_HELLOS), KWARGS),
    ("tensors", "tokenize", tokenize_body(chat_template_kwargs={"return_tensors": "np"}), KWARGS),
    ("tools text", "tokenize", tokenize_body(chat_template_kwargs={"tools": "abc"}), KWARGS),
    ("tools ints", "tokenize", tokenize_body(chat_template_kwargs={"tools": [1, 2]}), KWARGS),
    (
        "110k messages",
        "chat",
        chat_body(messages=[{"role": "user", "content": ""}] * 110_000),
        "messages",
    ),
    ("deep body", "chat", chat_body(metadata={"x": json.loads("[" * 200 + "]" * 200)}), "nested"),
    ("surrogate", "chat", chat_body(guided_json='{"enum": ["\\ud800"]}'), "lone surrogate"),
    (
        "surrogate",
        "chat",
        chat_body(structured_outputs={"json": '{"title": "\\udc00", "type": "string"}'}),
        "lone surrogate",
    ),
    (
        "surrogate tag",
        "chat",
        chat_body(
            structured_outputs={
                "structural_tag": '{"format": {"type": "const_string", "value": "\\ud800"}}'
            }
        ),
        "lone surrogate",
    ),
    ("deep text", "chat", chat_body(guided_json=DEEP_JSON_TEXT), "nested deeper"),
    ("bool tokens", "chat", chat_body(max_tokens=True), "max_tokens"),
    ("top_k 2^63", "chat", chat_body(top_k=2**63), "top_k"),
    ("bias 1_0", "chat", chat_body(logit_bias={"1_0": 1}), "logit_bias"),
    ("bias digits", "chat", chat_body(logit_bias={"١٢": 1}), "logit_bias"),
]


def post(base: str, route: str, body: dict, key: str = KEY_B) -> requests.Response:
    path = "/v1/chat/completions" if route == "chat" else "/tokenize"
    headers = {"Authorization": f"Bearer {key}"}
    return requests.post(f"{base}{path}", json=body, headers=headers, timeout=120)


def assert_openai_error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]  # JSON, in OpenAI's shape
    assert error["message"] and error["type"] == "invalid_request_error", error
    return error


def test_hostile_bodies_are_refused_before_any_work_while_a_victim_streams(server):
    victim = Victim(server)
    victim.start()
    assert victim.started.wait(120)
    for name, route, body, named in REFUSED:
        error = assert_openai_error(post(server, route, body), 400)
        assert named in f"{error['param']} {error['message']}", (name, error)
    victim.join(180)
    assert victim.error is None and victim.usage.completion_tokens == VICTIM_TOKENS
    assert requests.get(f"{server}/healthz", timeout=30).status_code == 200
    assert post(server, "chat", chat_body(), KEY_B).status_code == 200  # the next one is served


@pytest.mark.parametrize(
    "body",
    [
        chat_body(
            max_tokens=16,
            response_format={"type": "json_schema", "json_schema": {"schema": FREEZER}},
        ),
        chat_body(
            max_tokens=48,
            tools=[{"type": "function", "function": {"name": "f", "parameters": FREEZER}}],
            tool_choice="required",
        ),
    ],
    ids=["response_format", "tool parameters"],
)
def test_a_schema_that_would_freeze_validation_gets_a_bounded_answer(server, body):
    """Validating against it would hold a process's GIL for ~45 s (the replica's for an
    output, the ingress's for tool arguments): the worker doing it is killed at its deadline."""
    victim = Victim(server)
    victim.start()
    assert victim.started.wait(120)
    r = post(server, "chat", body)
    victim.join(180)
    assert victim.error is None and victim.usage.completion_tokens == VICTIM_TOKENS
    assert r.status_code == 200, r.text[:300]
    extra = r.json()["structserve"]
    assert extra["validated"] == [False], extra
    assert any("did not finish within" in w for w in extra["warnings"][0]), extra
    assert requests.get(f"{server}/healthz", timeout=30).status_code == 200


def test_every_route_that_costs_cpu_holds_a_slot_of_the_tenant(server):
    """tenant-one may run one request at a time: while its stream runs, its `/tokenize`,
    `/detokenize` and grammar listing are 429s like another chat would be."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        body = chat_body(max_tokens=200, stream=True, ignore_eos=True)
        headers = {"Authorization": f"Bearer {KEY_ONE}"}
        url = f"{server}/v1/chat/completions"
        with requests.post(url, json=body, headers=headers, stream=True, timeout=120) as r:
            for _ in r.iter_lines():
                held.set()
                if release.is_set():
                    break

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(120)
    try:
        headers = {"Authorization": f"Bearer {KEY_ONE}"}
        for method, path, body in (
            ("post", "/tokenize", {"model": MODEL, "prompt": "hi"}),
            ("post", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
            ("get", "/v1/grammars", None),
        ):
            r = requests.request(method, f"{server}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency", r.text
    finally:
        release.set()
        holder.join(60)
    # the stream's slot goes back once the server sees the client gone (its next write): the
    # tenant's next request is served after that, not refused for good
    deadline = time.monotonic() + 15
    r = post(server, "tokenize", {"model": MODEL, "prompt": "hi"}, KEY_ONE)
    while r.status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
        r = post(server, "tokenize", {"model": MODEL, "prompt": "hi"}, KEY_ONE)
    assert r.status_code == 200 and r.json()["count"] > 0


# -- the exception paths, swept: never a 5xx, never a body that is not JSON ---------------------

TEXTS = [
    '{"type": "string", "enum": ["\\ud800"]}',
    '{"type": "string", "enum": ["\\ud83d\\ude00"]}',  # a real pair: served
    '{"enum": ["\\udfff\\ud800"]}',
    DEEP_JSON_TEXT,
    "[" * 5000,
    '{"type": ',
    "null",
    '"\\ud800"',
    '{"$ref": "#/$defs/' + "a" * 2000 + '"}',
]
FIELDS = [
    lambda t: {"guided_json": t},
    lambda t: {"json_schema": t},
    lambda t: {"structured_outputs": {"json": t}},
    lambda t: {"structured_outputs": {"structural_tag": t}},
]
VARIABLES = [
    {"x": "text"},
    {"x": 1},
    {"x": 1.5},
    {"x": True},
    {"x": None},
    {"x": [1, "a", None]},
    {"x": {"a": 1}},
    {"x": [[1]]},
    {"": 1},
    {"chat_template": None},
    {"tools": None},
    {"documents": [{"title": "t"}]},
    {"messages": []},
    {"add_generation_prompt": False},
    {"sanitize_control_tokens": True},
    {"bos_token": "x"},
    {f"v{i}": i for i in range(40)},
    "not an object",
    [1, 2],
]


def sweep_cases() -> list[tuple[str, dict]]:
    cases = [("chat", chat_body(max_tokens=1, **field(text))) for text in TEXTS for field in FIELDS]
    for variables in VARIABLES:
        cases.append(("chat", chat_body(max_tokens=1, chat_template_kwargs=variables)))
        cases.append(("tokenize", tokenize_body(chat_template_kwargs=variables)))
    return cases


def test_the_ingress_exception_paths_answer_4xx_or_200_in_the_openai_shape(server):
    failures = []
    for route, body in sweep_cases():
        r = post(server, route, body, KEY_FUZZ)
        try:
            payload = r.json()
        except ValueError:
            failures.append((route, str(body)[:120], r.status_code, r.text[:120]))
            continue
        bad = r.status_code >= 500 or (r.status_code >= 400 and "error" not in payload)
        if bad:
            failures.append((route, str(body)[:120], r.status_code, r.text[:120]))
    assert not failures, failures


# -- what reaches Ray -------------------------------------------------------------------------


def test_every_ray_listener_is_on_loopback(server):
    """Ray started as `structserve serve` starts it (deployments/local_ray.py): the GCS, raylet,
    workers, agents, Serve's replicas and its proxy listen on loopback only."""
    me = psutil.Process()
    ours = {p.pid: p for p in [me, *me.children(recursive=True)]}
    listening = [
        (ours[c.pid].name(), c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    ]
    names = {name for name, _, _ in listening}
    assert "gcs_server" in names and "raylet" in names, listening  # the walk saw Ray's
    assert any(name.startswith("ray::ServeReplica") for name in names), listening
    loopback = ("127.", "::1", "::ffff:127.")
    exposed = [x for x in listening if not x[1].startswith(loopback)]
    assert not exposed, exposed
    # and on loopback, Ray's job route (code execution) asks for the run's token
    agent = [port for name, _, port in listening if "DashboardAgent" in name and port == 52365]
    if agent:
        job = {"entrypoint": "echo owned"}
        r = requests.post("http://127.0.0.1:52365/api/job_agent/jobs/", json=job, timeout=30)
        assert r.status_code == 401, r.text[:200]


def test_metrics_answer_no_one_without_the_token(server):
    r = requests.get(f"{server}/metrics", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    wrong = requests.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY_A}"})
    assert wrong.status_code == 401  # a tenant's key is not the metrics token
