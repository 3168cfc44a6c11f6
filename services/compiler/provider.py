"""`ServiceGrammarProvider`: the engine's `GrammarProvider` on top of the compile service.

Per grammar: the in-process LRU (compiled handles, bounded in bytes) → the service's verdict (Redis,
then a worker compile) → the handle, loaded from the verdict's blob or, where the service found
loading slower than compiling, compiled here. A grammar is only ever compiled in this process after
a worker has shown it compiles within the deadline and masks within budget.

Each `submit` is one `structserve.grammar.resolve` span (a child of the caller's current span),
tagged with the cache level that answered; the verdict call to the service runs inside it, so a
remote service's span joins the same trace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from grammar_registry.cache import LRUBytes, Verdict
from grammar_registry.specs import GrammarSpec
from services import telemetry
from services.compiler.service import CompilerConfig, CompileService, raise_for
from services.compiler.specs import to_spec, to_structured
from services.engine.grammar.backend import CompiledGrammar, GrammarError
from services.engine.grammar.fidelity import loosened_keywords
from services.engine.grammar.xgrammar_backend import XGrammarBackend, fidelity_error
from services.engine.params import StructuredOutput
from services.telemetry import spans

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Resolved(NamedTuple):
    compiled: CompiledGrammar
    level: str  # the cache level that answered (families.CACHE_LEVELS)


class VerdictSource(Protocol):
    """The compile service, in-process or behind a deployment handle."""

    def verdict(
        self, spec: GrammarSpec, tenant: str = ..., scope: str = ..., fresh: bool = ...
    ) -> Verdict: ...

    def resolve(self, tenant: str, grammar_id: str) -> GrammarSpec: ...

    def key(self, spec: GrammarSpec, scope: str = ...) -> str: ...

    def downgrade(
        self, spec: GrammarSpec, tenant: str, scope: str, reason: str, error: str
    ) -> None: ...

    def close(self) -> None: ...


class ServiceGrammarProvider:
    def __init__(
        self,
        backend: XGrammarBackend,
        service: VerdictSource,
        l1_bytes: int = 512 << 20,
        threads: int = 8,
        owns_service: bool = False,
        busy_wait_s: float = 120.0,
    ) -> None:
        self.backend = backend
        self.service = service
        self._owns_service = owns_service
        self.busy_wait_s = busy_wait_s
        self.l1 = LRUBytes(l1_bytes)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-resolve")
        self._lock = threading.Lock()
        self._loading: dict[str, Future[_Resolved]] = {}
        self.stats = {"l1": 0, "blob": 0, "local": 0}

    def submit(self, spec: StructuredOutput, tenant: str = "default") -> Future[CompiledGrammar]:
        """Resolves on a thread; an L1 hit is answered at once. Never raises: every failure is
        a failed future carrying a `GrammarError`."""
        attrs = {spans.GRAMMAR_KIND: spec.kind, spans.TENANT: tenant}
        span = telemetry.get().tracer.start_span(spans.GRAMMAR_RESOLVE, attributes=attrs)
        parent = trace.set_span_in_context(span)
        if spec.grammar_id is not None:  # a remote lookup: never on the caller's (engine) thread
            call = self._pool.submit(_within, parent, self._registered, spec, tenant)
            return _ended(_guarded(call, spec.kind), span)
        try:
            inner = self._submit(spec, tenant, parent)
        except GrammarError as exc:
            inner = _failed(exc)
        except Exception as exc:
            inner = _failed(GrammarError(f"structured.{spec.kind}: {exc!r}"[:300]))
        return _ended(inner, span)

    def _registered(self, spec: StructuredOutput, tenant: str) -> _Resolved:
        # Runs on a pool thread: loads inline rather than queueing a second task on the same pool
        # and waiting for it (a full pool of such waits would deadlock).
        gspec, scope = self._spec(spec, tenant)
        key = self.service.key(gspec, scope)
        hit = self._l1(key)
        found = _Resolved(hit, "l1") if hit is not None else self._load(gspec, tenant, scope, key)
        return _Resolved(self._judge(found.compiled, spec), found.level)

    def _submit(self, spec: StructuredOutput, tenant: str, parent: Any) -> Future[_Resolved]:
        try:
            gspec, scope = self._spec(spec, tenant)
            key = self.service.key(gspec, scope)
            hit = self._l1(key)
            if hit is not None:
                return _done(_Resolved(self._judge(hit, spec), "l1"))
        except GrammarError as exc:
            return _failed(exc)
        with self._lock:
            fut = self._loading.get(key)
            if fut is None:
                fut = self._pool.submit(_within, parent, self._load, gspec, tenant, scope, key)
                self._loading[key] = fut = _guarded(fut, gspec.kind)
        out: Future[_Resolved] = Future()

        def finish(done: Future[_Resolved]) -> None:
            with self._lock:
                self._loading.pop(key, None)
            try:
                found = done.result()
                out.set_result(_Resolved(self._judge(found.compiled, spec), found.level))
            except BaseException as exc:
                out.set_exception(exc)

        fut.add_done_callback(finish)
        return out

    def _l1(self, key: str) -> CompiledGrammar | None:
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
            warnings = loosened_keywords(gspec.source)
            if warnings:  # refused before any compile
                raise fidelity_error(warnings)
        return gspec, "shared"

    @staticmethod
    def _judge(compiled: CompiledGrammar, so: StructuredOutput) -> CompiledGrammar:
        if compiled.warnings and so.fidelity == "strict":
            raise fidelity_error(compiled.warnings)
        return compiled

    def _load(self, spec: GrammarSpec, tenant: str, scope: str, key: str) -> _Resolved:
        verdict = self._verdict_when_free(spec, tenant, scope)
        level = verdict.source or "compiled"
        trace.get_current_span().set_attribute(spans.CACHE_LEVEL, level)
        raise_for(verdict, spec.kind)
        handle = self._from_blob(verdict, key)
        if handle is None and verdict.blob is not None:
            # Unreadable (another tokenizer or serialization version, corrupt): replace it.
            verdict = self.service.verdict(spec, tenant, scope, fresh=True)
            raise_for(verdict, spec.kind)
            handle = self._from_blob(verdict, key)
        if handle is None:
            self.stats["local"] += 1
            start = time.perf_counter()
            handle = self.backend.compile(to_structured(spec)).handle
            labels = {"kind": spec.kind, "outcome": "ok", "where": "replica"}
            telemetry.get().metrics.grammar_compile.record(time.perf_counter() - start, labels)
        schema = _schema_of(spec)
        compiled = CompiledGrammar(handle, list(verdict.warnings), schema)
        self.l1.put(key, compiled, int(handle.memory_size_bytes))
        return _Resolved(compiled, level)

    def _verdict_when_free(self, spec: GrammarSpec, tenant: str, scope: str) -> Verdict:
        """A `busy` verdict means "not yet" to an engine: its request keeps waiting in the queue
        (as for any compile) and asks again, for up to `busy_wait_s`."""
        end = time.monotonic() + self.busy_wait_s
        pause = 0.05
        while True:
            verdict = self.service.verdict(spec, tenant, scope)
            if verdict.reason != "busy" or time.monotonic() + pause > end:
                return verdict
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

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

    def downgrade(self, spec: StructuredOutput, tenant: str, error: GrammarError) -> None:
        """Forgets the compiled grammar here at once; the refusal reaches the verdict cache on a
        resolver thread (a registered grammar's spec may need a remote lookup first)."""
        if spec.grammar_id is None:
            try:
                self.l1.pop(self.service.key(to_spec(spec), "shared"))
            except (GrammarError, ValueError):
                return  # it never compiled, so nothing holds it
        self._pool.submit(self._downgrade, spec, tenant, error)

    def _downgrade(self, spec: StructuredOutput, tenant: str, error: GrammarError) -> None:
        try:
            gspec, scope = self._spec(spec, tenant)
            self.l1.pop(self.service.key(gspec, scope))
            detail = str(error).removeprefix(f"structured.{spec.kind}: ")
            self.service.downgrade(gspec, tenant, scope, error.reason, detail)
        except Exception:  # the cache keeps the old verdict: the next request meets it again
            log.warning("grammar cache: downgrading a verdict failed", exc_info=True)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_service:
            self.service.close()


def _schema_of(spec: GrammarSpec) -> dict[str, Any] | None:
    if spec.kind == "json_schema":
        return dict(spec.source)
    if spec.kind == "json_object":
        return {"type": "object"}
    return None


def _within(parent: Any, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` with `parent` as the current trace context (pool threads have none)."""
    token = otel_context.attach(parent)
    try:
        return fn(*args)
    finally:
        otel_context.detach(token)


def _ended(inner: Future[_Resolved], span: Span) -> Future[CompiledGrammar]:
    """The compiled grammar of `inner`; ends the resolve span with its level and outcome."""
    out: Future[CompiledGrammar] = Future()

    def done(f: Future[_Resolved]) -> None:
        exc = f.exception()
        try:
            if exc is None:
                span.set_attribute(spans.CACHE_LEVEL, f.result().level)
                span.set_attribute(spans.GRAMMAR_OUTCOME, "ok")
            else:
                span.set_attribute(spans.GRAMMAR_OUTCOME, getattr(exc, "reason", "error"))
                span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
            span.end()
        except Exception:  # telemetry never fails a grammar
            log.debug("grammar span failed", exc_info=True)
        if exc is None:
            out.set_result(f.result().compiled)
        else:
            out.set_exception(exc)

    inner.add_done_callback(done)
    return out


def _guarded(fut: Future[T], kind: str) -> Future[T]:
    """`fut`, with any failure that is not a `GrammarError` turned into one."""
    out: Future[T] = Future()

    def done(f: Future[T]) -> None:
        exc = f.exception()
        if exc is None:
            out.set_result(f.result())
        elif isinstance(exc, GrammarError):
            out.set_exception(exc)
        else:
            out.set_exception(GrammarError(f"structured.{kind}: {exc!r}"[:300], reason="invalid"))

    fut.add_done_callback(done)
    return out


def _done(value: T) -> Future[T]:
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def _failed(exc: BaseException) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_exception(exc)
    return fut


def build_provider(
    backend: XGrammarBackend,
    workers: int,
    redis_url: str | None = None,
    config: CompilerConfig | None = None,
) -> ServiceGrammarProvider:
    """An engine's provider with its own compile service (offline use and one-process serving)."""
    client = None
    if redis_url:
        import redis

        client = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    cfg = (config or CompilerConfig()).model_copy(update={"workers": workers})
    service = CompileService(backend.tokenizer_info, cfg, redis=client)
    return ServiceGrammarProvider(backend, service, owns_service=True)
