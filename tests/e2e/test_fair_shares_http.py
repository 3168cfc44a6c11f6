"""Fair shares over HTTP, on the main application (two ingress replicas): a greedy tenant runs each
abusive pattern while a steady tenant keeps sending; the steady one sees no error and no 429.

Each pattern is bounded in count and time; timings are not asserted here (benchmarks/fair_http.py
measures the steady tenant's time to first token under each)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import requests
from e2e_support import KEY_GREEDY, KEY_ONE, KEY_STEADY, METRICS_TOKEN
from hostile import slow_compile_schema

MODEL = "SmolLM2-135M-Instruct"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(server: str, key: str, **body: Any) -> requests.Response:
    payload = {"model": MODEL, "prompt": "Name a colour:", "max_tokens": 4, **body}
    return requests.post(f"{server}/v1/completions", headers=auth(key), json=payload, timeout=120)


def small_schema(tag: str) -> dict[str, Any]:
    """A schema nobody sent before: its request needs a compile."""
    return {"type": "object", "properties": {tag: {"type": "integer"}}, "required": [tag]}


@contextmanager
def steady(server: str, grammars: bool = False) -> Iterator[list[int]]:
    """The steady tenant's requests, one after another, while the block runs: their statuses.
    With `grammars`, each under a schema it has not sent before."""
    statuses: list[int] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            body: dict[str, Any] = {}
            if grammars:
                body["structured_outputs"] = {"json": small_schema(f"b{uuid.uuid4().hex[:8]}")}
            statuses.append(completion(server, KEY_STEADY, **body).status_code)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        thread.join(timeout=120)


def check_steady(statuses: list[int]) -> None:
    assert statuses, "the steady tenant sent nothing"
    assert set(statuses) == {200}, statuses


def in_parallel(count: int, fn: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None] * count

    def one(i: int) -> None:
        out[i] = fn(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def raw_request(server: str, key: str, body: bytes, declared: int) -> socket.socket:
    """A POST whose headers promise `declared` bytes and whose body stops at `body`."""
    url = urlparse(server)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def status_of(sock: socket.socket) -> int:
    line = sock.makefile("rb").readline().decode()
    return int(line.split()[1]) if line else 0


def test_n16_floods_leave_the_steady_tenant_alone(server: str) -> None:
    flood = {"n": 16, "max_tokens": 16, "ignore_eos": True}
    with steady(server) as statuses:
        outs = in_parallel(2, lambda _: completion(server, KEY_GREEDY, **flood))
        third = completion(server, KEY_GREEDY, **flood)  # the first two may have ended: 200/429
    assert [r.status_code for r in outs] == [200, 200], [r.text[:300] for r in outs]
    assert all(len(r.json()["choices"]) == 16 for r in outs)
    assert third.status_code in (200, 429)
    check_steady(statuses)


def test_slow_bodies_hold_only_their_own_tenants_slots(server: str) -> None:
    """A body that never arrives holds one of its tenant's slots until the body deadline (408);
    the limit counts it (admission comes before the body), and the other tenant goes on."""
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "Hi'
    with steady(server) as statuses:
        socks = [raw_request(server, KEY_ONE, body, 400)]
        time.sleep(0.5)  # it has taken the tenant's one slot
        second = completion(server, KEY_ONE)
        assert second.status_code == 429
        assert second.json()["error"]["code"] == "concurrency"
        assert int(second.headers["Retry-After"]) >= 1
        assert status_of(socks[0]) == 408  # the body deadline (3 s in this deployment)
    check_steady(statuses)
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while (r := completion(server, KEY_ONE)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200  # the slot came back


def test_an_abort_storm_leaks_no_slots(server: str) -> None:
    """Streams dropped before their first byte, and right after it: every slot comes back."""
    stream = {"model": MODEL, "prompt": "Count:", "max_tokens": 64, "stream": True}
    url = f"{server}/v1/completions"
    with steady(server) as statuses:
        for i in range(12):
            if i % 2:
                with requests.post(
                    url, headers=auth(KEY_ONE), json=stream, stream=True, timeout=60
                ) as r:
                    if r.status_code == 200:
                        next(r.iter_lines())  # one event, then hang up
            else:
                raw = b'{"model": "%s", "prompt": "Count:", "stream": true}' % MODEL.encode()
                raw_request(server, KEY_ONE, raw, len(raw)).close()  # gone before the answer
    check_steady(statuses)
    deadline = time.monotonic() + 15
    while (r := completion(server, KEY_ONE)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200


def test_slow_and_deadline_grammars_hold_up_only_their_tenant(server: str) -> None:
    """The greedy tenant's grammars run to the compile deadline (5 s here; their workers are
    killed and restarted) or take seconds; the steady tenant's fresh grammars still compile."""
    tag = uuid.uuid4().hex[:6]

    def greedy(i: int) -> requests.Response:
        schema = slow_compile_schema(60 - i, parts=3) if i < 2 else slow_compile_schema(30 - i)
        # xgrammar's compile, which is what takes seconds (`auto` would build llguidance's)
        outputs = {"json": schema, "backend": "xgrammar"}
        body = {"structured_outputs": outputs, "prompt": f"{tag} {i}:"}
        return completion(server, KEY_GREEDY, **body)

    with steady(server, grammars=True) as statuses:
        outs = in_parallel(4, greedy)
    check_steady(statuses)
    assert len(statuses) >= 2
    codes = [r.status_code for r in outs]
    assert all(c in (200, 422, 429) for c in codes[2:]), [r.text[:200] for r in outs]
    assert all(c in (422, 429) for c in codes[:2]), [r.text[:200] for r in outs]  # refused


def test_ray_control_headers_from_clients_are_refused(server: str) -> None:
    for name, value in (
        ("x-request-disconnect-disabled", "?1"),
        ("x-request-timeout-seconds", "0"),
    ):
        r = requests.post(
            f"{server}/v1/completions",
            headers={**auth(KEY_STEADY), name: value},
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == name


def test_metrics_answer_only_the_metrics_token(server: str) -> None:
    assert requests.get(f"{server}/metrics", timeout=30).status_code == 401
    wrong = requests.get(f"{server}/metrics", headers=auth(KEY_STEADY), timeout=30)
    assert wrong.status_code == 401  # an API key is not the metrics token
    r = requests.get(f"{server}/metrics", headers=auth(METRICS_TOKEN), timeout=30)
    assert r.status_code == 200 and "structserve_requests" in r.text
