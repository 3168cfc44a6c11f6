"""Structured output inside the engine: compiles in flight, masks, acceptance and validation.

The engine calls this at fixed points of its step and never looks at a grammar itself. What goes
wrong for one request comes back as a `Failure` for the engine to fail that request alone.

The mask deadline: no step waits for one request's grammar past `mask_deadline_ms`; a request
whose mask or forced text is late leaves the step and is parked until it is in (late.py).

The mask budget: each request's mask fills are timed while it decodes (CPU time, read live
while a late fill still runs). Masks slower than `mask_budget_ms` add their time up; once a
request's slow masks add up to `mask_strikes` budgets (three slow masks, or one three times too
slow), it fails with a 422 and its grammar's verdict is downgraded in the cache
(`GrammarProvider.downgrade`), so the next request with that grammar is refused at admission.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from grammar_registry.family import MAX_PATH_CHARS
from services.engine.failures import RequestError
from services.engine.params import FinishReason
from services.engine.request import Request, StructuredRequest
from services.engine.structured.checked import Rollback, by_check, exclude, going_back, rewind
from services.engine.structured.forced import JumpForward
from services.engine.structured.late import LateRows, Parked
from services.engine.structured.masks import LateFill, MaskFiller, PendingMasks
from services.engine.structured.validation import OutputValidator
from services.grammar.backend import MASK_BUDGET_MS, GrammarError
from services.grammar.backends import Backends
from services.grammar.finish import MAX_UNIT, repeated_unit
from services.grammar.provider import GrammarProvider, ProviderFactory
from services.sandbox.validate import Located

log = logging.getLogger(__name__)


class Failure(NamedTuple):
    request: Request
    reason: str
    status: int  # what an HTTP client gets


def nothing_left(req: Request) -> Failure:
    """Checked decoding excluded every token the grammar allows where a failed value starts."""
    s = req.structured
    why = s.last_check if s is not None else ""
    return Failure(req, f"{why}; checked decoding: no other value is left to sample there", 422)


def _returns(n: int) -> str:
    return f"{n} return" + ("" if n == 1 else "s")


@runtime_checkable
class _Releasing(Protocol):
    """A provider whose futures are each caller's own (the compile service's): releasing one
    stops the wait, and a compile nobody waits for any more is dropped. A provider that hands
    one shared future to every caller (the local one) must never see it cancelled."""

    def release(self, future: Future[Any]) -> None: ...


@runtime_checkable
class _Provider(Protocol):
    """Tells a provider from a factory of one."""

    def submit(self, spec: Any, tenant: str = "default") -> Future[Any]: ...


def _name(s: StructuredRequest) -> str:
    """A grammar as logs and errors name it: its registered id, or a digest of its one key (no
    tenant's schema in a log)."""
    digest = hashlib.sha256(s.key.encode()).hexdigest()[:12]
    kind = s.spec.kind
    return f"{kind} {s.spec.grammar_id}" if s.spec.grammar_id else f"{kind} {digest}"


def _no_check(stage: str, req: Request) -> None:
    pass


def _internal(stage: str, exc: BaseException) -> str:
    return f"{stage}: internal error ({type(exc).__name__}: {exc})"[:300]


class GrammarManager:
    """`provider`: where compiled grammars come from, or a factory that makes it from the
    model's backends (called on the first structured request: unconstrained traffic never
    starts a compile service)."""

    def __init__(
        self,
        backend: Backends,
        provider: GrammarProvider | ProviderFactory,
        max_rows: int,
        overlap: bool = True,
        mask_budget_ms: float = MASK_BUDGET_MS,
        mask_strikes: float = 3.0,
        validation_timeout_s: float = 1.0,
        sandbox_workers: int = 2,
        mask_deadline_ms: float | None = None,
        mask_workers: int = 2,
        check_retries: int = 0,
    ) -> None:
        self.backend = backend
        self._tokenizer = backend.tokenizer
        self._max_rows = max_rows
        self._overlap = overlap
        self._provider: GrammarProvider | None = None
        self._factory: ProviderFactory | None = None
        if isinstance(provider, _Provider) and not isinstance(provider, type):  # a class makes one
            self._provider = provider
        else:
            self._factory = provider
        self._masks: MaskFiller | None = None
        self._pending: list[Request] = []
        self._whitespace: dict[int, bool] = {}
        self._mask_budget_s = mask_budget_ms / 1000
        self._mask_strikes = mask_strikes
        self._mask_deadline_ms = mask_deadline_ms
        self._mask_workers = mask_workers
        self._check_retries = check_retries
        self.late = LateRows(
            lambda: self.masks,
            self._mask_budget_s,
            mask_strikes,
            self._out_of_mask_budget,
            self._raised,
        )
        self.validator = OutputValidator(validation_timeout_s, sandbox_workers)
        # (stage, request) -> raises to fail it: the engine's fault injector, a no-op otherwise
        self.check: Callable[[str, Request], None] = _no_check
        self.slow_mask_failures = 0
        self.forced = JumpForward(self._tokenizer, lambda: self.masks, self.late, mask_deadline_ms)
        self.on_mask_fill: Callable[[float], None] | None = None

    @property
    def provider(self) -> GrammarProvider:
        if self._provider is None:
            assert self._factory is not None
            self._provider = self._factory(self.backend)
        return self._provider

    @property
    def masks(self) -> MaskFiller:
        if self._masks is None:
            self._masks = MaskFiller(
                self.backend,
                self._max_rows,
                self._overlap,
                on_fill=self._mask_filled,
                check=lambda req: self.check("mask", req),
                deadline_ms=self._mask_deadline_ms,
                workers=self._mask_workers,
            )
        return self._masks

    def _mask_filled(self, seconds: float) -> None:
        hook = self.on_mask_fill
        if hook is not None:
            try:
                hook(seconds)
            except Exception:  # telemetry never stops a step
                log.debug("mask fill hook failed", exc_info=True)

    def attach(self, req: Request) -> None:
        """Starts compiling the request's grammar; the request waits in the queue meanwhile."""
        spec = req.params.structured
        assert spec is not None
        req.structured = StructuredRequest(spec)
        req.structured.future = self.provider.submit(spec, req.tenant)
        self._pending.append(req)

    def resolve(self) -> list[Failure]:
        """Gives finished compiles their grammar state; returns requests whose grammar failed."""
        failed, still = [], []
        for req in self._pending:
            s = req.structured
            fut = s.future if s is not None else None
            if s is None or fut is None:
                continue
            if req.finished:
                self._release(req)
                continue
            if not fut.done():
                still.append(req)
                continue
            try:
                self.check("grammar", req)
                s.compiled = fut.result()
                s.state = self.backend.new_state(s.compiled)
            except Exception as exc:  # a GrammarError carries its status; anything else is ours
                status = int(getattr(exc, "status", 500))
                reason = str(exc) if isinstance(exc, GrammarError) else _internal("grammar", exc)
                failed.append(Failure(req, reason[:300], status))
                continue
            # the check stands in for the keywords the grammar leaves to it (checked.py)
            s.checked = bool(self._check_retries and s.compiled.warnings and s.compiled.schema)
            req.warnings.extend(by_check(s.compiled.warnings) if s.checked else s.compiled.warnings)
        self._pending = still
        return failed

    def _release(self, req: Request) -> None:
        """The request left (aborted, or failed elsewhere) before its grammar came."""
        fut = req.structured.future if req.structured is not None else None
        provider = self._provider
        if fut is not None and not fut.done() and isinstance(provider, _Releasing):
            provider.release(fut)

    def wait(self, timeout: float, validating: list[Request], also: Any = ()) -> None:
        """Blocks briefly when the only work left is grammars being compiled, outputs being
        validated or `also` (other futures: adapters being read), with no busy loop."""
        futures: list[Future[Any]] = [
            r.structured.future
            for r in self._pending
            if r.structured is not None and r.structured.future is not None
        ]
        futures += [r.validation.future for r in validating if r.validation is not None]
        futures += list(also)
        if self.late.requests and self._masks is not None and self._masks.workers is not None:
            self._masks.workers.wait_any(self.late.jobs(), timeout)
        elif futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def start_masks(self, sampling: list[Request]) -> PendingMasks | None:
        if not any(r.grammar is not None for r in sampling):
            return None
        return self.masks.start(sampling)

    def apply_masks(
        self, pending: PendingMasks | None, logits: torch.Tensor
    ) -> tuple[list[Failure], dict[int, LateFill]]:
        """Masks the rows whose fill is in; the requests whose grammar raised or that ran out of
        mask budget, and the rows whose fill missed the deadline (park them: `park`)."""
        masks = self.masks.apply(pending, logits) if pending is not None else None
        if masks is None or pending is None:
            return [], {}
        failed = []
        for i, req in pending.rows:
            s = req.structured
            assert s is not None  # rows with a grammar state
            exc = masks.failed.get(i)
            if exc is not None:
                failed.append(self._raised(req, s, exc))
                continue
            seconds = masks.seconds.get(i, 0.0)
            if seconds > self._mask_budget_s:
                s.mask_over_budget_s += seconds
            if s.mask_over_budget_s >= self._mask_strikes * self._mask_budget_s:
                failed.append(self._out_of_mask_budget(req, s))
            elif i not in masks.late and not self.exclude(req, logits, i):
                failed.append(nothing_left(req))
        return failed, masks.late

    @staticmethod
    def exclude(req: Request, logits: torch.Tensor, row: int) -> bool:
        """Masks what checked decoding excluded at `logits[row]`'s position (nothing to do,
        and no tensor touched, for a request that never went back); False: nothing left."""
        s = req.structured
        return (
            s is None or not s.excluded or exclude(s.excluded, req.num_output_tokens, logits[row])
        )

    def park(self, req: Request, fill: LateFill, logits: torch.Tensor) -> None:
        """`req` leaves the step until its late fill is in; `logits` [1, V] is its row."""
        self.late.park_mask(req, fill, logits)

    def resumable(self) -> tuple[list[tuple[Request, Parked]], list[Failure]]:
        """Parked requests whose grammar work is in, and those that failed while parked."""
        return self.late.poll()

    def _raised(self, req: Request, s: StructuredRequest, exc: BaseException) -> Failure:
        if isinstance(exc, GrammarError):  # past the backend's own limits (llguidance's)
            return self._refuse(req, s, exc)
        return Failure(req, _internal("mask", exc), 500)

    def _out_of_mask_budget(self, req: Request, s: StructuredRequest) -> Failure:
        """Fails the request whose slow masks added up to the strikes, naming its grammar."""
        budget_ms = self._mask_budget_s * 1000
        error = GrammarError(
            f"structured.{s.spec.kind}: masks slower than the budget ({budget_ms:g} ms a mask) "
            f"took {s.mask_over_budget_s * 1000:.0f} ms while decoding; the grammar "
            f"({_name(s)}) is refused",
            reason="slow_mask",
            status=422,
        )
        self.slow_mask_failures += 1
        return self._refuse(req, s, error)

    def _refuse(self, req: Request, s: StructuredRequest, error: GrammarError) -> Failure:
        """Fails the request, and refuses its grammar to its tenant from now on: a grammar
        that passed admission's probe but proved slow or past its limits while decoding is
        not admitted again on the next request."""
        backend = s.compiled.backend if s.compiled is not None else "xgrammar"
        log.info("grammar %s (%s): refused (%s)", _name(s), backend, error.reason)
        try:
            path = req.detokenizer.text if len(req.detokenizer.text) <= MAX_PATH_CHARS else ""
            self.provider.downgrade(s.spec, req.tenant, error, backend, path)
        except Exception:  # the request fails either way; the next one meets it again
            log.warning("grammar: downgrading a verdict failed", exc_info=True)
        return Failure(req, str(error)[:300], error.status)

    def accept(self, req: Request, token: int) -> FinishReason | None:
        """Advances the request's grammar: "stop" once it terminated; raises `RequestError`
        when the request cannot go on."""
        s = req.structured
        state = s.state if s is not None else None
        if s is None or state is None:
            return None
        try:
            accepted = state.accept_token(token)
        except GrammarError as exc:  # past the backend's own limits (llguidance's)
            raise RequestError(str(exc)[:300], exc.status) from exc
        if not accepted:  # the mask allowed it: a backend inconsistency
            raise RequestError(f"grammar: rejected the sampled token {token}", status=500)
        if state.is_terminated():
            return "stop"
        spec = s.spec
        s.whitespace_run = s.whitespace_run + 1 if self._is_whitespace(token) else 0
        if s.whitespace_run >= spec.max_whitespace_run:
            raise RequestError(
                f"structured.max_whitespace_run: {s.whitespace_run} whitespace-only tokens"
            )
        run = spec.max_repeat_run
        if run is not None and self._may_repeat(req, token, run):
            unit = repeated_unit([*req.token_ids[1 - run :], token], self._tokenizer.decode)
            if unit is not None:
                raise RequestError(
                    f"structured.max_repeat_run: the output repeated {unit[:40]!r} for {run} "
                    "tokens; ended early (raise max_repeat_run, or a repetition_penalty, to "
                    "let it run)",
                    status=422,
                )
        return None

    @staticmethod
    def _may_repeat(req: Request, token: int, run: int) -> bool:
        """A cheap screen before the repeat check copies the tail: long enough, and the new
        token equals the one a unit's length back."""
        ids = req.token_ids
        if len(ids) - req.num_prompt_tokens + 1 < run:
            return False
        return any(ids[-period] == token for period in range(1, MAX_UNIT + 1))

    def _is_whitespace(self, token: int) -> bool:
        known = self._whitespace.get(token)
        if known is None:
            text = self._tokenizer.decode([token])
            known = self._whitespace[token] = bool(text) and not text.strip()
        return known

    def start_validation(self, req: Request) -> bool:
        """Starts validating a finished JSON output off the engine thread; False when there is
        nothing to validate. Every request passes here as it finishes: one still waiting for
        its grammar stops waiting (an idle engine may not step again to notice)."""
        self._release(req)
        compiled = req.structured.compiled if req.structured is not None else None
        if compiled is None or compiled.schema is None or req.finish_reason in ("error", "abort"):
            return False
        req.validation = self.validator.submit(
            compiled, req.detokenizer.text, lambda: self.check("validate", req), req.tenant
        )
        return True

    def finish_validation(self, req: Request) -> bool | Rollback:
        """Records the verdict once it is in (True), turning a stop into an error when the
        output failed; False while it is still being validated; a `Rollback` when the request
        goes back to the value that failed instead (structured/checked.py: `rewind` it)."""
        assert req.validation is not None
        verdict = self.validator.answer(req.validation)
        if verdict is None:
            return False
        req.validation = None
        back = None if verdict[0] or req.finish_reason != "stop" else self._going_back(req, verdict)
        if back is not None:
            return back
        req.validated, why, _ = verdict
        s = req.structured
        if req.validated and s is not None and s.retries:
            req.warnings.append(f"checked decoding: passed its check after {_returns(s.retries)}")
        if why is not None:
            req.warnings.append(why)
        if not req.validated and req.finish_reason == "stop":
            req.finish_reason = "error"  # an output that does not parse never ends in "stop"
            req.error_status = 422
        return True

    def _going_back(self, req: Request, verdict: Located) -> Rollback | None:
        back = going_back(req, verdict, self._check_retries, self._tokenizer)
        s = req.structured
        if s is not None and back is not None:
            s.last_check = verdict[1] or ""
        elif s is not None and s.retries:
            req.warnings.append(f"checked decoding: {_returns(s.retries)} did not pass the check")
        return back

    def rewind(self, req: Request, back: Rollback) -> None:
        s = req.structured
        assert s is not None and s.compiled is not None
        compiled = s.compiled
        rewind(req, back, lambda: self.backend.new_state(compiled))

    def shutdown(self) -> None:
        self.validator.shutdown()
        if self._masks is not None:
            self._masks.shutdown()
        if self._provider is not None:
            self._provider.shutdown()
