"""What the provider (provider.py) stands on: the verdict source it asks, and the trace span of
each grammar it resolves."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import NamedTuple, Protocol

from opentelemetry.trace import Span, Status, StatusCode

from grammar_registry.cache import Verdict
from grammar_registry.specs import GrammarSpec
from services.compiler.futures import then
from services.grammar.backend import CompiledGrammar
from services.telemetry import spans

log = logging.getLogger(__name__)


class Resolved(NamedTuple):
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
        self, spec: GrammarSpec, tenant: str, scope: str, reason: str, error: str, path: str = ""
    ) -> None: ...

    def close(self) -> None: ...


def ended(inner: Future[Resolved], span: Span) -> Future[CompiledGrammar]:
    """The compiled grammar of `inner`; ends the resolve span with its level and outcome."""

    def end_span(f: Future[Resolved]) -> None:
        try:
            if f.cancelled():
                span.set_attribute(spans.GRAMMAR_OUTCOME, "cancelled")
            elif f.exception() is None:
                span.set_attribute(spans.CACHE_LEVEL, f.result().level)
                span.set_attribute(spans.GRAMMAR_BACKEND, f.result().compiled.backend)
                span.set_attribute(spans.GRAMMAR_OUTCOME, "ok")
            else:
                exc = f.exception()
                span.set_attribute(spans.GRAMMAR_OUTCOME, getattr(exc, "reason", "error"))
                span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
            span.end()
        except Exception:  # telemetry never fails a grammar
            log.debug("grammar span failed", exc_info=True)

    inner.add_done_callback(end_span)  # first: the span has ended when the caller hears
    return then(inner, lambda r: r.compiled)
