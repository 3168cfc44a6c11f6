"""`LocalBuilds`: llguidance grammars built in the engine's process, beside the compile service.

The compile service exists because an xgrammar compile is eager and unbounded: seconds, or
gigabytes, for a hostile schema, so it runs in killable workers behind a deadline and its verdicts
are cached. llguidance has no compile step to isolate: building its matcher parses the spec, and
its parser limits (lexer fuel per mask, grammar size) bound the work of every mask after it. So an
llguidance grammar is built in this process, on the same fair turns between tenants, after the
same static limits (`GrammarLimits`) the service applies, and decoding keeps the engine's mask
budget over it (a grammar whose masks prove slow is refused for its tenant from then on).

Which grammars are built here: those whose backend (the request's `StructuredOutput.backend`,
else the engine's `grammar_backend`) is llguidance, and under `auto` every JSON grammar, kept
when llguidance enforces each keyword of it; otherwise the service's xgrammar verdict decides, as
for every other grammar. `ServiceGrammarProvider` asks `builds_here` first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from grammar_registry.limits import GrammarLimits, LimitExceeded, check_limits
from services.compiler.dispatch import FairDispatcher
from services.compiler.futures import pipe, settle
from services.compiler.specs import to_spec
from services.engine.grammar.backend import CompiledGrammar, GrammarError
from services.engine.grammar.backends import Backends
from services.engine.params import StructuredOutput

MAX_REFUSED = 4096  # grammars refused for their tenant after slow masks, remembered here
Submit = Callable[[StructuredOutput, str], "Future[CompiledGrammar]"]  # the service's path


class _Build:
    def __init__(self, tenant: str, fn: Any, out: Future[CompiledGrammar]) -> None:
        self.tenant, self.fn, self.out = tenant, fn, out

    def run(self) -> None:
        if not self.out.cancelled():
            self.fn()

    def fail(self, exc: BaseException) -> None:
        settle(self.out, exc=exc)


class LocalBuilds:
    def __init__(
        self, backends: Backends, limits: GrammarLimits | None = None, threads: int = 2
    ) -> None:
        self.backends = backends
        self.limits = limits or GrammarLimits()
        self.dispatcher = FairDispatcher(threads, max(1, threads // 2), name="grammar-build")
        self._refused: OrderedDict[tuple[str, str], GrammarError] = OrderedDict()

    def builds_here(self, spec: StructuredOutput) -> bool:
        if spec.grammar_id is not None:
            return False  # a registration: the service holds it
        name = spec.backend or self.backends.default
        return name == "llguidance" or (
            name == "auto" and (spec.json_schema is not None or spec.json_object)
        )

    def submit(
        self, spec: StructuredOutput, tenant: str, service: Submit
    ) -> Future[CompiledGrammar]:
        """Built in the tenant's turn; `service` answers what llguidance leaves to xgrammar."""
        out: Future[CompiledGrammar] = Future()
        build = _Build(tenant, lambda: self._build(spec, tenant, out, service), out)
        self.dispatcher.submit(build)
        return out

    def _build(
        self, spec: StructuredOutput, tenant: str, out: Future[CompiledGrammar], service: Submit
    ) -> None:
        auto = (spec.backend or self.backends.default) == "auto"
        try:
            gspec = to_spec(spec)
            refused = self._refused.get((tenant, gspec.canonical()))
            if refused is None:
                check_limits(gspec, self.limits)
                judged = replace(spec, fidelity="warn") if auto else spec
                compiled = self.backends.llguidance.compile(judged)
        except LimitExceeded as exc:
            settle(out, exc=GrammarError(f"structured.{spec.kind}: {exc}", reason="limit"))
            return
        except GrammarError as exc:
            if auto:  # llguidance cannot build it: xgrammar's verdict decides
                pipe(service(spec, tenant), out)
            else:
                settle(out, exc=exc)
            return
        except Exception as exc:
            settle(out, exc=GrammarError(f"structured.{spec.kind}: {exc!r}"[:300]))
            return
        if refused is not None:  # its masks proved slow for this tenant
            settle(out, exc=refused)
        elif auto and compiled.warnings:  # not every keyword: xgrammar's verdict decides
            pipe(service(spec, tenant), out)
        else:
            settle(out, compiled)

    def downgrade(self, spec: StructuredOutput, tenant: str, error: GrammarError) -> None:
        """Refuses the grammar for the tenant from now on (its masks proved slow)."""
        try:
            key = (tenant, to_spec(spec).canonical())
        except (GrammarError, ValueError):
            return
        self._refused[key] = error
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)

    def close(self) -> None:
        self.dispatcher.close(
            GrammarError("structured: the grammar provider shut down", "unavailable", 503)
        )
