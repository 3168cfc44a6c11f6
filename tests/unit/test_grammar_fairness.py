"""Fair shares of grammar resolution between tenants (the grammar path), with fakes:
a scripted verdict source for the provider, fake worker processes for the pool and the service.

What must hold: a busy verdict parks a load without holding a thread, and another tenant's grammar
resolves meanwhile; a load nobody waits for is dropped before it asks the service; a worker restart
is charged to the tenant whose compile caused it; the last idle worker is kept for a tenant with
nothing in flight.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import xgrammar as xgr

from grammar_registry import GrammarSpec, Verdict
from services import SamplingParams, StructuredOutput
from services.compiler import CompilerConfig, CompileService, ServiceGrammarProvider
from services.engine.request import Request, RequestStatus
from services.engine.structured.manager import GrammarManager
from services.grammar import GrammarError
from services.grammar.backends import Backends
from services.sandbox import WorkerPool
from services.sandbox import pool as pool_module


class FakeBackend:
    """What the provider needs of `XGrammarBackend` when verdicts carry no blob."""

    def compile(self, spec: Any) -> Any:
        return SimpleNamespace(handle=SimpleNamespace(memory_size_bytes=64))


class ScriptedService:
    """A `VerdictSource` whose answers depend on the tenant: `busy` for those in `busy`, a wait
    on `hold` (a slow compile) for those in `slow`, else a fresh ok."""

    def __init__(self, busy: tuple[str, ...] = (), slow: tuple[str, ...] = ()) -> None:
        self.busy, self.slow = busy, slow
        self.hold = threading.Event()
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str]] = []  # (tenant, regex)
        self.inside = 0  # verdict calls in progress
        self.most_inside = 0
        self.lookups = 0  # registered grammars looked up

    def key(self, spec: GrammarSpec, scope: str = "shared") -> str:
        return f"{scope}:{spec.model_dump_json()}"

    def verdict(
        self, spec: GrammarSpec, tenant: str = "default", scope: str = "shared", fresh: bool = False
    ) -> Verdict:
        with self.lock:
            self.calls.append((tenant, str(spec.source)))
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            if tenant in self.busy:
                return Verdict(ok=False, reason="busy", error="no compile worker free; try later")
            if tenant in self.slow:
                assert self.hold.wait(30)
            return Verdict(ok=True, compile_s=0.01, source="compiled")
        finally:
            with self.lock:
                self.inside -= 1

    def asked(self, regex: str) -> int:
        with self.lock:
            return sum(1 for _, r in self.calls if r == regex)

    def resolve(self, tenant: str, grammar_id: str) -> GrammarSpec:
        self.lookups += 1
        return GrammarSpec(kind="regex", source=grammar_id)

    def downgrade(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


def provider_for(service: ScriptedService, **kw: Any) -> ServiceGrammarProvider:
    return ServiceGrammarProvider(FakeBackend(), service, **kw)  # type: ignore[arg-type]


def regex(i: int | str) -> StructuredOutput:
    return StructuredOutput(regex=f"[a-z]+{i}")


def until(check: Any, within_s: float = 5.0) -> bool:
    end = time.monotonic() + within_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


# -- the provider: fair, event-driven, cancellable -------------------------------------------------


def test_busy_loads_are_parked_without_threads_and_another_tenant_resolves_at_once():
    service = ScriptedService(busy=("A",))
    provider = provider_for(service, threads=8, busy_wait_s=1.5)
    try:
        mine = [provider.submit(regex(i), "A") for i in range(40)]
        # every load asked once and is parked: none holds a thread while it waits
        assert until(lambda: provider.dispatcher.snapshot()["parked"] == 40)
        assert provider.dispatcher.snapshot()["running"] <= 1
        start = time.monotonic()
        theirs = provider.submit(regex("b"), "B").result(timeout=5)
        assert theirs.handle is not None and time.monotonic() - start < 0.5
        # the overall deadline stays: busy after `busy_wait_s` is the answer
        for fut in mine:
            with pytest.raises(GrammarError) as err:
                fut.result(timeout=10)
            assert err.value.reason == "busy" and err.value.status == 429
        assert service.asked("[a-z]+0") < 15  # backed off, not polled
    finally:
        provider.shutdown()


def test_a_compile_ending_retries_parked_loads_before_their_backoff_is_due():
    service = ScriptedService(busy=("A",))
    provider = provider_for(service, busy_wait_s=30)
    try:
        mine = provider.submit(regex(1), "A")
        assert until(lambda: service.asked("[a-z]+1") >= 6)  # now parked for a whole second
        service.busy = ()  # B's compile frees the worker A waits for
        provider.submit(regex("b"), "B").result(timeout=5)
        start = time.monotonic()
        mine.result(timeout=5)
        assert time.monotonic() - start < 0.5
    finally:
        provider.shutdown()


def test_a_tenant_with_slow_compiles_holds_at_most_its_share_of_threads():
    service = ScriptedService(slow=("A",))
    provider = provider_for(service, threads=8, tenant_threads=3)
    try:
        mine = [provider.submit(regex(i), "A") for i in range(20)]
        assert until(lambda: service.inside == 3)
        start = time.monotonic()
        provider.submit(regex("b"), "B").result(timeout=5)
        assert time.monotonic() - start < 0.5  # not behind A's twenty
        assert provider.dispatcher.snapshot()["ready"] == 17  # the rest of A's wait their turn
        service.hold.set()
        for fut in mine:
            fut.result(timeout=10)
        assert service.most_inside <= 4  # A's three, then B's
    finally:
        service.hold.set()
        provider.shutdown()


def test_the_reserve_thread_goes_to_a_tenant_with_nothing_running():
    service = ScriptedService(slow=("A", "C"))
    provider = provider_for(service, threads=3, tenant_threads=3)
    try:
        held = [provider.submit(regex(i), "A") for i in range(5)]
        assert until(lambda: service.inside == 2)  # A never takes the third, last thread
        held.append(provider.submit(regex("c"), "C"))
        assert until(lambda: service.inside == 3)  # C had nothing running: it may
        assert provider.dispatcher.snapshot()["running"] == 3
    finally:
        service.hold.set()
        for fut in held:
            fut.result(timeout=10)
        provider.shutdown()


def test_cancelling_every_waiter_drops_the_queued_load_before_it_asks():
    service = ScriptedService(slow=("A",))
    provider = provider_for(service, threads=2, tenant_threads=1)
    try:
        first = provider.submit(regex(1), "A")
        assert until(lambda: service.inside == 1)
        waiters = [provider.submit(regex(2), "A") for _ in range(3)]  # one load, queued
        shared = [provider.submit(regex(3), "A") for _ in range(2)]
        for fut in waiters:
            assert fut.cancel()
        shared[0].cancel()  # the other caller still waits: the load stays
        service.hold.set()
        first.result(timeout=5)
        assert shared[1].result(timeout=5) is not None
        assert service.asked("[a-z]+2") == 0  # dropped: the service never heard of it
        assert service.asked("[a-z]+3") == 1
        assert provider.dispatcher.snapshot() == {"running": 0, "ready": 0, "parked": 0}
    finally:
        service.hold.set()
        provider.shutdown()


def test_a_registered_grammar_cancelled_in_the_queue_is_never_looked_up():
    service = ScriptedService(slow=("A",))
    provider = provider_for(service, threads=2, tenant_threads=1)
    try:
        first = provider.submit(regex(1), "A")
        assert until(lambda: service.inside == 1)
        queued = provider.submit(StructuredOutput(grammar_id="gr_" + "0" * 24), "A")
        assert queued.cancel()
        service.hold.set()
        first.result(timeout=5)
        assert until(lambda: provider.dispatcher.snapshot()["running"] == 0)
        assert service.lookups == 0
    finally:
        service.hold.set()
        provider.shutdown()


def test_a_parked_load_nobody_waits_for_never_asks_again():
    service = ScriptedService(busy=("A",))
    provider = provider_for(service, busy_wait_s=30)
    try:
        fut = provider.submit(regex(1), "A")
        assert until(lambda: provider.dispatcher.snapshot()["parked"] == 1)
        asked = service.asked("[a-z]+1")
        fut.cancel()
        time.sleep(0.5)  # past several of its backoff steps
        assert service.asked("[a-z]+1") == asked
        assert provider.dispatcher.snapshot()["parked"] == 0
    finally:
        provider.shutdown()


def test_the_manager_releases_the_grammar_of_an_aborted_request():
    service = ScriptedService(slow=("A",))
    provider = provider_for(service, threads=2, tenant_threads=1)
    manager = GrammarManager(Backends(None, 8, []), provider, 4)
    try:
        blocker = provider.submit(regex(0), "A")
        assert until(lambda: service.inside == 1)
        params = SamplingParams(max_tokens=4, structured=regex(1))
        req = Request("r1", [1, 2], params, detokenizer=None, tenant="A")  # type: ignore[arg-type]
        manager.attach(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"  # the engine's `_finish`
        assert manager.start_validation(req) is False
        assert req.structured is not None and req.structured.future is not None
        assert req.structured.future.cancelled()
        service.hold.set()
        blocker.result(timeout=5)
        assert until(lambda: provider.dispatcher.snapshot()["running"] == 0)
        assert service.asked("[a-z]+1") == 0
    finally:
        service.hold.set()
        provider.shutdown()


# -- the pool and the service: restarts charged, a worker in reserve ------------------------------


class FakeConn:
    """A worker's socket: a job holds its worker while `job["hold"]` is unset, or (a spec with
    "slow" in it) past any deadline."""

    def __init__(self) -> None:
        self.job: dict[str, Any] = {}

    def send(self, job: dict[str, Any]) -> None:
        self.job = job

    def poll(self, timeout: float) -> bool:
        if "slow" in self.job.get("spec", ""):
            threading.Event().wait(timeout)
            return False
        hold = self.job.get("hold")
        return True if hold is None else bool(hold.wait(timeout))

    def recv(self) -> dict[str, Any]:
        # load_s above compile_s: the service keeps no blob ("compile locally")
        out = {"ok": True, "warnings": [], "blob": b"x", "compile_s": 0.01, "load_s": 1.0}
        return {**out, "mask_ms": 0.1}

    def close(self) -> None:
        pass


class FakeWorker:
    """Starts at once, except replacements while `restart_gate` is unset."""

    restart_gate = threading.Event()
    starts = 0

    def __init__(self, role: str, setup: dict[str, Any], memory_bytes: int) -> None:
        self.conn = FakeConn()
        self.proc = SimpleNamespace(pid=0)

    def start(self, timeout: float) -> str:
        FakeWorker.starts += 1
        if FakeWorker.starts > 2:
            assert FakeWorker.restart_gate.wait(30)
        return ""

    def cpu_seconds(self) -> float | None:
        return None  # unknown: the wall clock decides, as it does where /proc cannot tell

    def kill(self) -> None:
        pass


@pytest.fixture
def fake_workers(monkeypatch):
    monkeypatch.setattr(pool_module, "_Worker", FakeWorker)
    FakeWorker.starts = 0
    FakeWorker.restart_gate = threading.Event()
    yield FakeWorker
    FakeWorker.restart_gate.set()


def test_a_tenant_with_a_compile_in_flight_cannot_take_the_last_worker(fake_workers):
    pool = WorkerPool("compile", {}, workers=2, memory_bytes=0)
    try:
        assert pool.wait_ready(5)
        hold = threading.Event()
        first = threading.Thread(target=pool.run, args=({"hold": hold}, 30, 0, "A"))
        first.start()
        assert until(lambda: pool.in_flight("A") == 1)
        refused = pool.run({}, deadline_s=30, wait_s=0.2, tenant="A")
        assert refused["reason"] == "busy", refused
        assert "kept for tenants with nothing compiling" in refused["error"]
        assert pool.run({}, deadline_s=30, wait_s=0.2, tenant="B")["ok"]  # B may
        hold.set()
        first.join(5)
        assert pool.run({}, deadline_s=30, wait_s=0.2, tenant="A")["ok"]  # A again, once idle
    finally:
        pool.close()


@pytest.mark.parametrize("per_tenant", [1, 4])
def test_a_tenant_whose_compiles_time_out_pays_for_the_restart(fake_workers, per_tenant):
    config = CompilerConfig(
        workers=2, deadline_s=0.2, queue_wait_s=0.3, max_inflight_per_tenant=per_tenant
    )
    pool = WorkerPool("compile", {}, workers=2, memory_bytes=0)
    service = CompileService(xgr.TokenizerInfo(["a", "b", "c"]), config, pool=pool)
    try:
        assert pool.wait_ready(5)
        slow = GrammarSpec(kind="regex", source="slow[a-z]")
        assert service.verdict(slow, "A").reason == "timeout"
        assert pool.restarting("A") == 1 and pool.kills == 1
        # A's next grammar is refused while the replacement starts, B's compiles meanwhile
        start = time.monotonic()
        refused = service.verdict(GrammarSpec(kind="regex", source="[a-z]+1"), "A")
        assert refused.reason == "busy", refused
        assert time.monotonic() - start < config.queue_wait_s + 0.5
        if per_tenant == 1:  # at admission: the restart is one of its compiles in flight
            assert "restarting" in refused.error
        assert service.verdict(GrammarSpec(kind="regex", source="[a-z]+2"), "B").ok
        fake_workers.restart_gate.set()
        assert pool.wait_ready(5)
        assert pool.restarting("A") == 0
        assert service.verdict(GrammarSpec(kind="regex", source="[a-z]+1"), "A").ok
        assert pool.charged_s["A"] > 0 and "B" not in pool.charged_s
    finally:
        service.close()


def test_a_load_busy_when_the_dispatcher_closes_is_answered_not_lost():
    """The provider shuts down while a load is asking the service; the service says busy (the
    load would be parked again): its waiter gets the shutdown error instead of waiting forever."""
    from services.compiler.dispatch import FairDispatcher

    asking, answered = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    class Busy:
        tenant = "A"

        def run(self) -> float | None:
            asking.set()
            answered.wait(5)
            return 0.05  # busy: run me again later

        def fail(self, exc: BaseException) -> None:
            failed.append(exc)

    dispatcher = FairDispatcher(threads=2, per_tenant=1)
    dispatcher.submit(Busy())
    assert asking.wait(5)
    gone = RuntimeError("shut down")
    dispatcher.close(gone)
    answered.set()
    assert until(lambda: failed == [gone])
