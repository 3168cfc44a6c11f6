"""`ServiceGrammarProvider`: the engine's `GrammarProvider` on top of the compile service.

Per grammar: the in-process LRU (compiled handles, bounded in bytes) → the service's verdict (Redis,
then a worker compile) → the handle, loaded from the verdict's blob or, where the service found
loading slower than compiling, compiled here. A grammar is only ever compiled in this process after
a worker has shown it compiles within the deadline and masks within budget.

Loads are shared by key (single flight) and run on a `FairDispatcher`: tenants take turns for the
resolver threads, and a `busy` verdict parks the load (no thread waits for it) until a compile
ends here or its backoff is due, for up to `busy_wait_s`. Every caller gets a future of its own:
cancelling it leaves the load, and a load nobody waits for any more is dropped before it asks the
service again (one already compiling on a worker finishes, and its verdict is cached).

Each `submit` is one `structserve.grammar.resolve` span (a child of the caller's current span),
tagged with the cache level that answered; the verdict call to the service runs inside it, so a
remote service's span joins the same trace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace

from grammar_registry.cache import LRUBytes, Verdict
from grammar_registry.specs import GrammarSpec
from services import telemetry
from services.compiler.dispatch import FairDispatcher
from services.compiler.futures import done, failed, pipe, settle, then
from services.compiler.local_builds import LocalBuilds
from services.compiler.resolving import Resolved, VerdictSource, ended
from services.compiler.service import raise_for
from services.grammar.backend import CompiledGrammar, GrammarError
from services.grammar.canonical import schema_of, to_spec, to_structured
from services.grammar.fidelity import loosened_keywords
from services.grammar.fold import folded
from services.grammar.structured import StructuredOutput
from services.grammar.xgrammar_backend import XGrammarBackend, fidelity_error
from services.telemetry import spans

log = logging.getLogger(__name__)
T = TypeVar("T")

BUSY_PAUSE_S = (0.05, 1.0)  # a parked load's first wait, doubling up to the second
DOWNGRADE_KEPT_S = 600.0  # as long as the compile service keeps a refusal (failure_ttl_s)


class _Load:
    """One grammar's resolution, shared by every request that waits for it (single flight)."""

    def __init__(
        self,
        provider: ServiceGrammarProvider,
        spec: GrammarSpec,
        tenant: str,
        scope: str,
        key: str,
        parent: Any,
    ) -> None:
        self.provider, self.spec, self.key = provider, spec, key
        self.tenant, self.scope = tenant, scope
        self.parent = parent  # the first caller's trace context: the attempts are its children
        self.deadline = time.monotonic() + provider.busy_wait_s
        self.pause = BUSY_PAUSE_S[0]
        self.waiters = 0  # callers whose futures are not cancelled; under the provider's lock
        self.future: Future[Resolved] = Future()

    def run(self) -> float | None:
        return _within(self.parent, self.provider._attempt, self)

    def fail(self, exc: BaseException) -> None:
        settle(self.future, exc=exc)


class _Call:
    """A one-off task in its tenant's turn: a registered grammar's lookup, a downgrade."""

    def __init__(self, tenant: str, fn: Callable[[], None], out: Future[Any] | None = None):
        self.tenant, self.fn, self.out = tenant, fn, out

    def run(self) -> None:
        self.fn()

    def fail(self, exc: BaseException) -> None:
        if self.out is not None:
            settle(self.out, exc=exc)


class ServiceGrammarProvider:
    def __init__(
        self,
        backend: XGrammarBackend,
        service: VerdictSource,
        l1_bytes: int = 512 << 20,
        threads: int = 8,
        owns_service: bool = False,
        busy_wait_s: float = 120.0,
        tenant_threads: int | None = None,  # default: half the threads
        local: LocalBuilds | None = None,  # llguidance grammars, built in this process
        share_inline: bool = False,
    ) -> None:
        # Inline grammars are cached per tenant unless `share_inline`: a shared cache would tell
        # a tenant (by the time its request takes) which schemas another tenant just sent.
        self.share_inline = share_inline
        self.backend = backend
        self.local = local
        self.service = service
        self._owns_service = owns_service
        self.busy_wait_s = busy_wait_s
        self.l1 = LRUBytes(l1_bytes)
        # (key, tenant) -> (refusal, until): a tenant's downgrades, which an L1 hit must meet too
        # (the entry may be another tenant's, compiled fine for it)
        self._downgraded: dict[tuple[str, str], tuple[GrammarError, float]] = {}
        self.dispatcher = FairDispatcher(threads, tenant_threads or max(1, threads // 2))
        self._lock = threading.Lock()
        self._loading: dict[str, _Load] = {}
        self.stats = {"l1": 0, "blob": 0, "local": 0}

    def submit(self, spec: StructuredOutput, tenant: str = "default") -> Future[CompiledGrammar]:
        """An L1 hit is answered at once, the rest in the tenant's turn. Never raises: every
        failure is a failed future carrying a `GrammarError`. Cancel the future to stop waiting."""
        attrs = {spans.GRAMMAR_KIND: spec.kind, spans.TENANT: tenant}
        span = telemetry.get().tracer.start_span(spans.GRAMMAR_RESOLVE, attributes=attrs)
        parent = trace.set_span_in_context(span)
        try:
            if spec.grammar_id is not None:  # a remote lookup: never on the caller's thread
                inner = self._registered(spec, tenant, parent)
            elif self.local is not None and self.local.builds_here(spec):
                service = lambda s, t: then(self._submit(s, t, parent), _compiled)  # noqa: E731
                inner = then(self.local.submit(spec, tenant, service), _built)
            else:
                inner = self._submit(spec, tenant, parent)
        except Exception as exc:  # after `shutdown` too: the dispatcher takes no more tasks
            inner = failed(_grammar_error(exc, spec.kind))
        return ended(inner, span)

    def release(self, future: Future[CompiledGrammar]) -> None:
        """The caller stops waiting (its request left): the same as cancelling the future."""
        future.cancel()

    def _submit(self, spec: StructuredOutput, tenant: str, parent: Any) -> Future[Resolved]:
        gspec, scope = self._spec(spec, tenant)
        key = self.service.key(gspec, scope)
        hit = self._l1(key, tenant)
        if hit is not None:
            return done(Resolved(self._judge(hit, spec), "l1"))
        return then(self._join(gspec, tenant, scope, key, parent), lambda r: self._judged(r, spec))

    def _registered(self, so: StructuredOutput, tenant: str, parent: Any) -> Future[Resolved]:
        out: Future[Resolved] = Future()
        joined: list[Future[Resolved]] = []

        def look() -> None:
            try:
                gspec, scope = self._spec(so, tenant)
                key = self.service.key(gspec, scope)
                hit = self._l1(key, tenant)
                found = (
                    done(Resolved(hit, "l1"))
                    if hit is not None
                    else self._join(gspec, tenant, scope, key, parent)
                )
            except Exception as exc:
                settle(out, exc=_grammar_error(exc, so.kind))
                return
            joined.append(found)
            pipe(found, out, lambda r: self._judged(r, so))
            if out.cancelled():  # cancelled while it looked the spec up
                found.cancel()

        call = _Call(tenant, lambda: _within(parent, look), out)

        def left(f: Future[Resolved]) -> None:
            if f.cancelled() and not self.dispatcher.cancel(call):
                for found in joined:
                    found.cancel()

        out.add_done_callback(left)
        self.dispatcher.submit(call)
        return out

    def _join(
        self, spec: GrammarSpec, tenant: str, scope: str, key: str, parent: Any
    ) -> Future[Resolved]:
        """A future of the key's load (started when none is under way); cancelling it leaves."""
        with self._lock:
            load = self._loading.get(key)
            if load is None:
                load = _Load(self, spec, tenant, scope, key, parent)
                self.dispatcher.submit(load)
                self._loading[key] = load
            load.waiters += 1
        mine: Future[Resolved] = Future()
        pipe(load.future, mine)
        mine.add_done_callback(lambda f: self._leave(load) if f.cancelled() else None)
        return mine

    def _leave(self, load: _Load) -> None:
        with self._lock:
            load.waiters -= 1
            if load.waiters or not self.dispatcher.cancel(load):
                return  # others wait, or it is running: what it compiles gets cached
            self._forget(load)
        load.future.cancel()

    def _forget(self, load: _Load) -> None:
        if self._loading.get(load.key) is load:
            del self._loading[load.key]

    def _attempt(self, load: _Load) -> float | None:
        """One try at the load's verdict on a dispatcher thread: the seconds to wait before the
        next try when the service is busy, else None (the load is answered)."""
        with self._lock:
            gone = not load.waiters  # everyone left while it was parked: never ask again
            if gone:
                self._forget(load)
        if gone:
            load.future.cancel()
            return None
        try:
            verdict = self.service.verdict(load.spec, load.tenant, load.scope)
            if verdict.reason == "busy" and time.monotonic() + load.pause <= load.deadline:
                pause, load.pause = load.pause, min(load.pause * 2, BUSY_PAUSE_S[1])
                return pause
            if verdict.source == "compiled":  # a worker came free: parked loads try now
                self.dispatcher.wake()
            found = self._loaded(load, verdict)
        except Exception as exc:
            self._answer(load, exc=_grammar_error(exc, load.spec.kind))
        else:
            self._answer(load, found)
        return None

    def _answer(
        self, load: _Load, found: Resolved | None = None, exc: BaseException | None = None
    ) -> None:
        with self._lock:
            self._forget(load)
        settle(load.future, found, exc)

    def _l1(self, key: str, tenant: str) -> CompiledGrammar | None:
        """The compiled grammar in this process; `GrammarError` for the tenant's downgrade."""
        refused = self._downgraded.get((key, tenant))
        if refused is not None and refused[1] > time.monotonic():
            raise refused[0]
        hit: CompiledGrammar | None = self.l1.get(key)
        if hit is not None:
            self.stats["l1"] += 1
            telemetry.get().metrics.grammar_cache.add(1, {"level": "l1"})
        return hit

    def _spec(self, so: StructuredOutput, tenant: str) -> tuple[GrammarSpec, str]:
        if so.grammar_id is not None:
            return self.service.resolve(tenant, so.grammar_id), tenant
        gspec = to_spec(so)
        if so.fidelity == "strict" and gspec.kind == "json_schema":
            folding = folded(gspec.source, so.strict)
            warnings = loosened_keywords(folding.schema) + folding.left
            if warnings:  # refused before any compile
                raise fidelity_error(warnings)
        return gspec, "shared" if self.share_inline else tenant

    @staticmethod
    def _judge(compiled: CompiledGrammar, so: StructuredOutput) -> CompiledGrammar:
        if compiled.warnings and so.fidelity == "strict":
            raise fidelity_error(compiled.warnings)
        return compiled

    def _judged(self, found: Resolved, so: StructuredOutput) -> Resolved:
        return Resolved(self._judge(found.compiled, so), found.level)

    def _loaded(self, load: _Load, verdict: Verdict) -> Resolved:
        """The compiled grammar the verdict allows (a `busy` one that outlasted `busy_wait_s`
        is a refusal like the others)."""
        spec, key = load.spec, load.key
        level = verdict.source or "compiled"
        trace.get_current_span().set_attribute(spans.CACHE_LEVEL, level)
        raise_for(verdict, spec.kind)
        handle = self._from_blob(verdict, key)
        if handle is None and verdict.blob is not None:
            # Unreadable (another tokenizer or serialization version, corrupt): replace it.
            verdict = self.service.verdict(spec, load.tenant, load.scope, fresh=True)
            raise_for(verdict, spec.kind)
            handle = self._from_blob(verdict, key)
        if handle is None:
            self.stats["local"] += 1
            start = time.perf_counter()
            handle = self.backend.compile(to_structured(spec)).handle
            labels = {"kind": spec.kind, "outcome": "ok", "where": "replica"}
            telemetry.get().metrics.grammar_compile.record(time.perf_counter() - start, labels)
        schema = schema_of(spec)
        compiled = CompiledGrammar(handle, list(verdict.warnings), schema)
        self.l1.put(key, compiled, int(handle.memory_size_bytes))
        return Resolved(compiled, level)

    def _from_blob(self, verdict: Verdict, key: str) -> Any | None:
        if verdict.blob is None:
            return None
        try:
            handle = self.backend.load(verdict.blob_json())
        except Exception as exc:  # xgrammar raises on a version or tokenizer mismatch
            log.warning("grammar cache: blob for %s does not load (%s)", key[-12:], exc)
            return None
        self.stats["blob"] += 1
        return handle

    def downgrade(
        self,
        spec: StructuredOutput,
        tenant: str,
        error: GrammarError,
        backend: str = "xgrammar",
        path: str = "",
    ) -> None:
        """Forgets the compiled grammar here at once; the refusal reaches the verdict cache on a
        resolver thread (a registered grammar's spec may need a remote lookup first).
        llguidance's grammars are refused where they were built (`LocalBuilds`)."""
        if backend == "llguidance" and self.local is not None:
            self.local.downgrade(spec, tenant, error)
            return
        if spec.grammar_id is None:
            try:
                gspec, scope = self._spec(spec, tenant)
            except (GrammarError, ValueError):
                return  # it never compiled, so nothing holds it
            self._refuse_here(self.service.key(gspec, scope), tenant, scope, error)
        self.dispatcher.submit(_Call(tenant, lambda: self._downgrade(spec, tenant, error, path)))

    def _refuse_here(self, key: str, tenant: str, scope: str, error: GrammarError) -> None:
        now = time.monotonic()
        with self._lock:
            self._downgraded = {k: v for k, v in self._downgraded.items() if v[1] > now}
            self._downgraded[(key, tenant)] = (error, now + DOWNGRADE_KEPT_S)
        if scope != "shared":  # a shared entry serves the other tenants still
            self.l1.pop(key)

    def _downgrade(
        self, spec: StructuredOutput, tenant: str, error: GrammarError, path: str
    ) -> None:
        try:
            gspec, scope = self._spec(spec, tenant)
            self._refuse_here(self.service.key(gspec, scope), tenant, scope, error)
            detail = str(error).removeprefix(f"structured.{spec.kind}: ")
            self.service.downgrade(gspec, tenant, scope, error.reason, detail, path)
        except Exception:  # the cache keeps the old verdict: the next request meets it again
            log.warning("grammar cache: downgrading a verdict failed", exc_info=True)

    def shutdown(self) -> None:
        if self.local is not None:
            self.local.close()
        self.dispatcher.close(
            GrammarError("structured: the grammar provider shut down", "unavailable", 503)
        )
        if self._owns_service:
            self.service.close()


def _within(parent: Any, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` with `parent` as the current trace context (pool threads have none)."""
    token = otel_context.attach(parent)
    try:
        return fn(*args)
    finally:
        otel_context.detach(token)


def _compiled(found: Resolved) -> CompiledGrammar:
    return found.compiled


def _built(compiled: CompiledGrammar) -> Resolved:
    return Resolved(compiled, "compiled")


def _grammar_error(exc: Exception, kind: str) -> GrammarError:
    if isinstance(exc, GrammarError):
        return exc
    return GrammarError(f"structured.{kind}: {exc!r}"[:300], reason="invalid")
