"""Validation of finished JSON outputs against their schema, off the engine thread.

The schema is the tenant's, so validating must never raise into the engine nor hold it: each
output is checked in a killable worker process under a deadline (services/sandbox/validate.py
says why a thread cannot be enough), from a small thread pool here that waits on the workers, and
an answer past the deadline is `validated=False` with that reason. The engine polls `answer`;
it never blocks on a validation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from services.grammar.backend import CompiledGrammar
from services.sandbox.validate import Located, SchemaValidator, schema_text

# Past the worker's own deadline: the time to take a worker, send the job and hear back (a
# worker that outlives this is answered for here, and killed by the pool).
SLACK_S = 2.0


def schema_of(compiled: CompiledGrammar) -> str:
    """The compiled grammar's schema as JSON text, made once (cached on it)."""
    if compiled.schema_text is None:
        compiled.schema_text = schema_text(compiled.schema if compiled.schema is not None else {})
    return compiled.schema_text


@dataclass
class PendingValidation:
    future: Future[Located]
    deadline: float  # time.monotonic()


class OutputValidator:
    """`submit` starts one output's validation; `answer` says whether it has its verdict."""

    def __init__(self, timeout_s: float = 1.0, workers: int = 2) -> None:
        self.timeout_s = timeout_s
        self.schemas = SchemaValidator(workers, timeout_s, wait_s=timeout_s + SLACK_S)
        # waiting on workers costs no CPU: enough threads that a stuck check queues no one
        self._threads = ThreadPoolExecutor(max(2, 2 * workers), thread_name_prefix="validate")

    def submit(
        self, compiled: CompiledGrammar, text: str, check: Callable[[], None], tenant: str
    ) -> PendingValidation:
        """`check` runs first on the validation thread (the fault injector's hook)."""
        schema = schema_of(compiled)

        def run() -> Located:
            try:
                check()
                return self.schemas.locate([(schema, text)], tenant)[0]
            except Exception as exc:  # never into the engine: the request gets the reason
                return False, f"validate: internal error ({type(exc).__name__}: {exc})"[:300], None

        deadline = time.monotonic() + 2 * self.timeout_s + 2 * SLACK_S
        return PendingValidation(self._threads.submit(run), deadline)

    def answer(self, pending: PendingValidation) -> Located | None:
        """The verdict once ready; past the deadline, a refusal; else None (not yet)."""
        if pending.future.done():
            return pending.future.result()
        if time.monotonic() < pending.deadline:
            return None
        pending.future.cancel()
        return False, f"output validation did not finish within {self.timeout_s:g} s", None

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.schemas.close()
