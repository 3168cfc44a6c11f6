"""The trust boundary's pieces, each beside what a well-behaved tenant still gets: a body's shape
checked before pydantic, key lookups that cannot reach Redis, slots of streams that ended while
Redis hung, compile faults charged to no one, per-tenant grammar caches and metric views."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import fakeredis
import pytest
import xgrammar as xgr
from test_grammar_fairness import FakeBackend, ScriptedService, regex

from deployments.answers import ApiError
from deployments.edge import BodyLimits, screen
from deployments.gate import Gate
from deployments.observe import RequestObs
from deployments.quota import Quota
from deployments.service_config import ServiceConfig, TenantConfig, TenantLimits
from deployments.tenants import Tenants, digest
from grammar_registry import GrammarSpec
from services.compiler import CompilerConfig, CompileService, ServiceGrammarProvider
from services.telemetry import Telemetry, TelemetrySettings

LIMITS = BodyLimits(max_bytes=4 << 20, timeout_s=5, max_depth=16, max_values=1000, max_messages=8)


# -- the body's shape, before pydantic --------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{}] * 9}, "messages: at most 8 messages"),
        ({"x": json.loads("[" * 17 + "]" * 17)}, "body: nested deeper than 16 levels"),
        ({"logit_bias": {str(i): 1 for i in range(1001)}}, "body: more than 1000 JSON values"),
    ],
    ids=["messages", "depth", "values"],
)
def test_a_body_past_its_shape_limits_is_refused_before_it_is_validated(body, message):
    with pytest.raises(ApiError, match=message) as refused:
        screen(json.dumps(body).encode(), LIMITS)
    assert refused.value.status == 400
    screen(json.dumps({"messages": [{}] * 8, "x": [[1]]}).encode(), LIMITS)  # within: passes


def test_a_body_too_deep_for_the_json_parser_is_a_400():
    with pytest.raises(ApiError, match="nested deeper"):
        screen(b"[" * 100_000 + b"]" * 100_000, LIMITS)


# -- API keys while Redis cannot answer -------------------------------------------------------


class Unreachable:
    def hget(self, *_: Any) -> Any:
        raise ConnectionError("Redis is down")


def test_a_key_redis_cannot_check_is_a_503_never_a_401_and_configured_keys_still_work():
    config = ServiceConfig(tenants=[TenantConfig(name="a", api_key_sha256=[digest("sk-a")])])
    tenants = Tenants(config, redis=Unreachable())
    gate = Gate(config, tenants, llm=None)

    class Request:
        def __init__(self, key: str) -> None:
            self.headers = {"authorization": f"Bearer {key}"}

    async def check() -> None:
        assert await gate.tenant(Request("sk-a")) == "a"
        for _ in range(2):  # the lookup that failed, then the wait before Redis is asked again
            with pytest.raises(ApiError) as refused:
                await gate.tenant(Request("sk-kept-in-redis"))
            assert refused.value.status == 503 and refused.value.retry_after >= 1
        assert await gate.tenant(Request("sk-a")) == "a"

    asyncio.run(check())


# -- a stream that ends while Redis hangs ------------------------------------------------------


class Hanging:
    """A Redis client whose calls fail while `hung` (a Redis that does not answer in time)."""

    def __init__(self) -> None:
        self.real = fakeredis.FakeRedis()
        self.hung = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.real, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.hung:
                raise TimeoutError("Redis did not answer")
            out = attr(*args, **kwargs)
            return Hanging.wrap(self, out) if name == "pipeline" else out

        return call

    @staticmethod
    def wrap(owner: Hanging, pipe: Any) -> Any:
        execute = pipe.execute

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if owner.hung:
                raise TimeoutError("Redis did not answer")
            return execute(*args, **kwargs)

        pipe.execute = guarded
        return pipe


def test_a_slot_released_while_redis_hung_is_freed_when_it_answers():
    clock = [1000.0]
    redis = Hanging()
    quota = Quota(redis, clock=lambda: clock[0])
    lim = TenantLimits(max_concurrent=1)
    lease = quota.admit("idle", lim)
    redis.hung = True
    quota.release(lease, lim)  # the stream ended meanwhile: Redis missed the release
    redis.hung = False
    clock[0] += 6  # past the local count's few seconds
    again = quota.admit("idle", lim)  # its one slot is free: no 429 until the lease expired
    quota.release(again, lim)
    assert redis.real.zcard("structserve:quota:{idle}:active") == 0


# -- compile faults ---------------------------------------------------------------------------


class ScriptedPool:
    """Answers compile jobs from a script, in order (the last answer repeats); `gate` holds the
    first job until set."""

    def __init__(self, *answers: str, gate: threading.Event | None = None) -> None:
        self.answers, self.jobs, self.gate = list(answers), 0, gate

    def run(self, job: dict, deadline_s: float, wait_s: float, tenant: str = "") -> dict:
        self.jobs += 1
        if self.jobs == 1 and self.gate is not None:
            assert self.gate.wait(10)
        answer = self.answers[min(self.jobs, len(self.answers)) - 1]
        if answer == "ok":
            return {"ok": True, "warnings": [], "compile_s": 0.01, "mask_ms": 0.1}
        return {"ok": False, "reason": answer, "error": f"scripted {answer}"}

    def restarting(self, tenant: str) -> int:
        return 0

    def close(self) -> None:
        pass


def service_with(pool: ScriptedPool) -> CompileService:
    info = xgr.TokenizerInfo(["a", "b", "c"])
    return CompileService(info, CompilerConfig(), pool=pool)  # type: ignore[arg-type]


SPEC = GrammarSpec(kind="regex", source="[a-c]+")


def test_a_crash_is_tried_again_before_it_becomes_a_verdict():
    pool = ScriptedPool("crash", "ok")
    service = service_with(pool)
    assert service.verdict(SPEC, "A").ok and pool.jobs == 2


def test_a_timeout_with_no_worker_for_a_second_try_is_answered_but_not_kept():
    pool = ScriptedPool("timeout", "busy", "ok")
    service = service_with(pool)
    assert service.verdict(SPEC, "A").reason == "timeout"
    assert service.verdict(SPEC, "A").ok  # judged again, not served from a cache


def test_joiners_of_a_compile_that_crashed_compile_on_their_own():
    gate = threading.Event()
    pool = ScriptedPool("crash", "crash", "ok", gate=gate)
    service = service_with(pool)
    first: list = []
    owner = threading.Thread(target=lambda: first.append(service.verdict(SPEC, "A")))
    owner.start()
    joined: list = []
    joiner = threading.Thread(target=lambda: joined.append(service.verdict(SPEC, "B")))
    while pool.jobs == 0:
        threading.Event().wait(0.01)
    joiner.start()
    threading.Event().wait(0.2)  # B has joined A's compile
    gate.set()
    owner.join(10), joiner.join(10)
    assert first[0].reason == "crash"  # A's two tries crashed
    assert joined[0].ok and pool.jobs == 3  # B did not take A's crash: its own compile


def test_a_tenants_crash_is_not_its_answer_once_a_compile_has_a_verdict():
    pool = ScriptedPool("crash", "crash", "ok")
    service = service_with(pool)
    assert service.verdict(SPEC, "A").reason == "crash"
    assert service.verdict(SPEC, "B").ok  # B's own compile: the grammar is fine
    assert service.verdict(SPEC, "A").ok and pool.jobs == 3


# -- per-tenant grammar caches ----------------------------------------------------------------


@pytest.mark.parametrize("share", [False, True])
def test_inline_grammars_are_compiled_per_tenant_unless_shared(share):
    service = ScriptedService()
    provider = ServiceGrammarProvider(FakeBackend(), service, share_inline=share)  # type: ignore[arg-type]
    try:
        for tenant in ("A", "B", "A"):
            provider.submit(regex(1), tenant).result(timeout=5)
        asked = [t for t, _ in service.calls]
        assert asked == (["A"] if share else ["A", "B"])  # B never learns what A sent
    finally:
        provider.shutdown()


def test_a_downgrade_holds_on_cache_hits_too():
    """Shared: A's downgrade (masks too slow in its decoding) refuses A even though the
    compiled grammar stays in the L1 for B."""
    from services.grammar import GrammarError

    service = ScriptedService()
    provider = ServiceGrammarProvider(FakeBackend(), service, share_inline=True)  # type: ignore[arg-type]
    try:
        provider.submit(regex(1), "A").result(timeout=5)
        provider.downgrade(regex(1), "A", GrammarError("structured.regex: slow", "slow_mask", 422))
        assert provider.submit(regex(1), "B").result(timeout=5)  # an L1 hit for B
        with pytest.raises(GrammarError, match="slow"):
            provider.submit(regex(1), "A").result(timeout=5)
    finally:
        provider.shutdown()


# -- what a metrics scrape tells ---------------------------------------------------------------


@pytest.mark.parametrize("labels", [False, True])
def test_metric_series_name_tenants_only_when_asked(labels):
    tel = Telemetry(TelemetrySettings(tenant_labels=labels), "test")
    for tenant in ("a", "b"):
        obs = RequestObs(tel, "chat", {})
        obs.tenant = tenant
        obs.finish(200)
    (family,) = tel.snapshot()
    points = {tuple(sorted(p["labels"].items())): p["value"] for p in family["points"]}
    if labels:
        assert points[(("route", "chat"), ("status", "200"), ("tenant", "a"))] == 1
    else:
        assert points == {(("route", "chat"), ("status", "200")): 2}
    tel.shutdown()


# -- errors in the OpenAI shape ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [(409, "invalid_request_error"), (413, "invalid_request_error"), (503, "service_unavailable")],
)
def test_every_status_has_the_error_type_its_class_means(status, kind):
    from deployments.answers import error_response

    body = json.loads(error_response(ApiError(status, "name: 'x' is already registered")).body)
    assert body["error"]["type"] == kind  # a 409 (a name taken) is the client's, not ours
