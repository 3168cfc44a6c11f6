"""`LocalBuilds`: llguidance grammars built in the engine's process, beside the compile service.

The compile service exists because an xgrammar compile is eager and unbounded: seconds, or
gigabytes, for a hostile schema, so it runs in killable workers behind a deadline and its verdicts
are cached. llguidance has no compile step to isolate: building its matcher parses the spec, and
its parser limits (lexer fuel per mask, grammar size: `GrammarLimits`, the same limits the service
applies) bound the work of every mask after it. So an llguidance grammar is built in this process,
on fair turns between tenants, and judged as a worker judges a compile: the static limits before
it, the mask-time probe (`probe.py`) after it, and decoding keeps the engine's mask budget over it.

What a build shows is a `Verdict` for backend llguidance, kept here in an LRU with the built
grammar (each request copies it): building and probing takes about a millisecond, less than
fetching a verdict from Redis, so these stay out of it. Refusals the machine's load can cause (a
slow probe; masks over the budget while decoding, `downgrade`) are kept for the tenant that met
them only, and for `refusal_ttl_s`, as the service keeps its own.

Which grammars come here: those whose backend (the request's `StructuredOutput.backend`, else the
engine's `grammar_backend`) is llguidance, and under `auto` every JSON grammar. Under `auto` the
verdict is the choice: llguidance when it enforces every keyword and masks within budget;
otherwise the service's xgrammar verdict decides, and when both loosen keywords the one loosening
fewer wins (`backends.prefer`). `ServiceGrammarProvider` asks `builds_here` first.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from grammar_registry.cache import Verdict
from grammar_registry.limits import GrammarLimits, LimitExceeded, check_limits
from services import telemetry
from services.compiler.dispatch import FairDispatcher
from services.compiler.futures import settle
from services.compiler.probe import PROBE_STEPS, probe_masks
from services.compiler.service import LOAD_DEPENDENT, CompilerConfig, refusal
from services.grammar.backend import MASK_BUDGET_MS, CompiledGrammar, GrammarError
from services.grammar.backends import Backends, prefer
from services.grammar.canonical import to_spec
from services.grammar.structured import StructuredOutput
from services.grammar.xgrammar_backend import fidelity_error

MAX_VERDICTS = 4096  # llguidance verdicts (with their built grammars) kept here
Submit = Callable[[StructuredOutput, str], "Future[CompiledGrammar]"]  # the service's path


@dataclass(frozen=True)
class Judged:
    verdict: Verdict  # backend "llguidance"
    compiled: CompiledGrammar | None  # what each request copies; None for a refusal
    expires: float = math.inf  # time.monotonic(); a refusal the load may have caused expires


class _Build:
    def __init__(self, tenant: str, fn: Any, out: Future[CompiledGrammar]) -> None:
        self.tenant, self.fn, self.out = tenant, fn, out

    def run(self) -> None:
        if self.out.cancelled():
            return
        try:
            self.fn()
        except Exception as exc:  # the request must get an answer, whatever went wrong
            error = (
                exc if isinstance(exc, GrammarError) else GrammarError(f"structured: {exc!r}"[:300])
            )
            settle(self.out, exc=error)

    def fail(self, exc: BaseException) -> None:
        settle(self.out, exc=exc)


class LocalBuilds:
    def __init__(
        self,
        backends: Backends,
        limits: GrammarLimits | None = None,
        mask_budget_ms: float = MASK_BUDGET_MS,
        probe_steps: int = PROBE_STEPS,
        threads: int = 2,
        refusal_ttl_s: float = 600.0,
        share_inline: bool = False,  # verdicts shared between tenants (provider.py says why not)
    ) -> None:
        self.share_inline = share_inline
        self.backends = backends
        self.limits = limits or GrammarLimits()
        backends.use_limits(self.limits)  # llguidance's parser limits
        self.mask_budget_ms = mask_budget_ms
        self.probe_steps = probe_steps
        # a refusal the load may have caused is judged again after this, as the service's
        # Redis copy of one expires (`CompilerConfig.failure_ttl_s`)
        self.refusal_ttl_s = refusal_ttl_s
        self.dispatcher = FairDispatcher(threads, max(1, threads // 2), name="grammar-build")
        self._verdicts: OrderedDict[str, Judged] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0  # llguidance grammars built and probed (what the verdicts save)

    @classmethod
    def from_config(cls, backends: Backends, config: CompilerConfig) -> LocalBuilds:
        """With the compile service's limits, mask budget, probe and refusal lifetime."""
        return cls(
            backends,
            config.limits,
            config.mask_budget_ms,
            config.probe_steps,
            refusal_ttl_s=config.failure_ttl_s,
        )

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
        build = _Build(tenant, lambda: self._answer(spec, tenant, out, service), out)
        self.dispatcher.submit(build)
        return out

    def verdict(self, spec: StructuredOutput, tenant: str) -> Judged:
        """llguidance's verdict on the grammar: the tenant's own refusal first, then the shared
        verdict, else a build (after the static limits: raises `LimitExceeded`) and a probe."""
        gspec = to_spec(spec)
        key = self._key(gspec.canonical(), tenant)
        found = self._get(_scoped(key, tenant)) or self._get(key)
        if found is not None:
            return found
        check_limits(gspec, self.limits)
        judged = self._judge(spec)
        if judged.verdict.reason in LOAD_DEPENDENT:
            self._put_refusal(_scoped(key, tenant), judged)
        else:
            self._put(key, judged)
        return judged

    def _judge(self, spec: StructuredOutput) -> Judged:
        backend = self.backends.llguidance
        self.builds += 1
        start = time.perf_counter()
        try:
            compiled = backend.compile(replace(spec, fidelity="warn"))  # judged per request
            build_s = time.perf_counter() - start
            budget = self.mask_budget_ms
            probe = probe_masks(backend, compiled, self.probe_steps, 0, 4 * budget)
            mask_ms = probe.worst_ms if probe.slow_path is not None else probe.median_ms
        except GrammarError as exc:  # invalid, or past the parser's limits while probing
            error = str(exc).removeprefix(f"structured.{spec.kind}: ").removeprefix("structured: ")
            return Judged(_refused(exc.reason, error), None)
        labels = {"kind": spec.kind, "where": "replica"}
        if mask_ms > budget:
            error = f"masks take {mask_ms:.1f} ms (budget {budget:g} ms)"
            telemetry.get().metrics.grammar_compile.record(
                build_s, {**labels, "outcome": "slow_mask"}
            )
            return Judged(_refused("slow_mask", error, build_s, mask_ms), None)
        telemetry.get().metrics.grammar_compile.record(build_s, {**labels, "outcome": "ok"})
        verdict = Verdict(
            ok=True,
            warnings=list(compiled.warnings),
            compile_s=build_s,
            mask_ms=mask_ms,
            backend="llguidance",
        )
        return Judged(verdict, compiled)

    def _answer(
        self, spec: StructuredOutput, tenant: str, out: Future[CompiledGrammar], service: Submit
    ) -> None:
        auto = (spec.backend or self.backends.default) == "auto"
        try:
            judged = self.verdict(spec, tenant)
        except LimitExceeded as exc:
            settle(out, exc=GrammarError(f"structured.{spec.kind}: {exc}", reason="limit"))
            return
        except Exception as exc:
            error = (
                exc
                if isinstance(exc, GrammarError)
                else GrammarError(f"structured.{spec.kind}: {exc!r}"[:300])
            )
            settle(out, exc=error)
            return
        verdict, compiled = judged.verdict, judged.compiled
        if compiled is not None and not (auto and verdict.warnings):
            if verdict.warnings and spec.fidelity == "strict":
                settle(out, exc=fidelity_error(verdict.warnings))
            else:
                settle(out, compiled)
        elif not auto:
            settle(out, exc=refusal(verdict, spec.kind))
        else:  # llguidance loosens a keyword, or refused: xgrammar's verdict decides
            try:
                asked = service(spec, tenant)  # raises at once what it refuses without a compile
            except GrammarError as exc:
                settle(out, exc=exc)
                return
            _choose(asked, compiled, spec.fidelity == "strict", out)

    def downgrade(self, spec: StructuredOutput, tenant: str, error: GrammarError) -> None:
        """Refuses llguidance's grammar for the tenant from now on (its masks proved slow);
        under `auto` the tenant's next request with it goes to xgrammar."""
        try:
            key = self._key(to_spec(spec).canonical(), tenant)
        except (GrammarError, ValueError):
            return
        detail = str(error).removeprefix(f"structured.{spec.kind}: ")
        self._put_refusal(_scoped(key, tenant), Judged(_refused(error.reason, detail), None))

    def _key(self, canonical: str, tenant: str) -> str:
        return canonical if self.share_inline else f"{canonical}\x00scope:{tenant}"

    def _put_refusal(self, key: str, judged: Judged) -> None:
        self._put(key, replace(judged, expires=time.monotonic() + self.refusal_ttl_s))

    def _get(self, key: str) -> Judged | None:
        with self._lock:
            found = self._verdicts.get(key)
            if found is not None and found.expires <= time.monotonic():
                del self._verdicts[key]
                return None
            if found is not None:
                self._verdicts.move_to_end(key)
            return found

    def _put(self, key: str, judged: Judged) -> None:
        with self._lock:
            self._verdicts[key] = judged
            self._verdicts.move_to_end(key)
            while len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)

    def close(self) -> None:
        self.dispatcher.close(
            GrammarError("structured: the grammar provider shut down", "unavailable", 503)
        )


def _scoped(key: str, tenant: str) -> str:
    return f"{key}\x00tenant:{tenant}"  # a canonical spec is JSON: it never holds a NUL


def _refused(reason: str, error: str, compile_s: float = 0.0, mask_ms: float = 0.0) -> Verdict:
    return Verdict(
        ok=False,
        reason=reason,
        error=error,
        compile_s=compile_s,
        mask_ms=mask_ms,
        backend="llguidance",
    )


def _choose(
    xgrammar: Future[CompiledGrammar],
    guided: CompiledGrammar | None,
    strict: bool,
    out: Future[CompiledGrammar],
) -> None:
    """`out` gets xgrammar's grammar, or llguidance's (`guided`, which loosens some keyword)
    where that loosens no more, or where xgrammar refuses and `fidelity` is `warn`."""

    def decide(f: Future[CompiledGrammar]) -> None:
        if f.cancelled():
            out.cancel()
        elif f.exception() is None:
            settle(out, f.result() if guided is None else prefer(guided, f.result()))
        elif guided is not None and not strict:
            settle(out, guided)
        else:
            settle(out, exc=f.exception())

    xgrammar.add_done_callback(decide)
    out.add_done_callback(lambda f: xgrammar.cancel() if f.cancelled() else None)
