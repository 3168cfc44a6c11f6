"""Validation of finished JSON outputs against their schema, where it cannot hurt anyone.

The schema is the tenant's: it may hold keywords the grammar does not enforce (`not`, `pattern`
inside them, unresolvable `$ref`s), so validating must never raise into the engine nor hold its
thread. Hence:
- `jsonschema-rs` (Rust): its default regex engine runs patterns without catastrophic
  backtracking (plain patterns in linear time, lookaround ones under a backtrack limit), where
  Python's `re` under the `jsonschema` package held the GIL for minutes on `(a+)+$`; it is also
  hundreds of times faster. Formats are checked: on MaskBench's 1428 labelled instances it agrees
  with every label that way (the `jsonschema` package, which treats formats as annotations,
  missed 38).
- one validator built per compiled grammar (cached on it), on a thread of its own;
- a time bound: an answer not ready in `timeout_s` is `validated=False`, with that reason.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jsonschema_rs

from services.engine.grammar.backend import CompiledGrammar

Verdict = tuple[bool, str | None]  # (validated, why not)
_BUILD_LOCK = threading.Lock()


def _validator(compiled: CompiledGrammar) -> Any:
    """The compiled grammar's validator, built on first use; raises when the schema is
    unusable (the reason goes to the request, the next request raises the same)."""
    with _BUILD_LOCK:
        if compiled.validator is None:
            try:
                schema = compiled.schema if compiled.schema is not None else {}
                compiled.validator = jsonschema_rs.validator_for(schema, validate_formats=True)
            except Exception as exc:  # unresolvable $ref, an invalid keyword value, ...
                compiled.validator = exc
        validator = compiled.validator
    if isinstance(validator, Exception):
        raise ValueError(_first_line(validator)) from validator
    return validator


def validate(compiled: CompiledGrammar, text: str) -> Verdict:
    try:
        validator = _validator(compiled)
    except ValueError as exc:
        return False, f"schema could not be used to validate: {exc}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return False, f"output failed validation: not JSON ({_first_line(exc)})"
    error = next(iter(validator.iter_errors(value)), None)
    if error is not None:
        return False, f"output failed validation: {_first_line(error)}"
    return True, None


def _first_line(exc: Any) -> str:
    text = str(getattr(exc, "message", None) or exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


@dataclass
class PendingValidation:
    future: Future[Verdict]
    deadline: float  # time.monotonic()


class OutputValidator:
    """Validates on a thread of its own; `answer` says whether a validation has its verdict."""

    def __init__(self, timeout_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self._pool = self._new_pool()
        self.timeouts = 0

    @staticmethod
    def _new_pool() -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix="validate")

    def submit(
        self, compiled: CompiledGrammar, text: str, check: Callable[[], None]
    ) -> PendingValidation:
        """`check` runs first on the validation thread (the fault injector's hook)."""

        def run() -> Verdict:
            try:
                check()
                return validate(compiled, text)
            except Exception as exc:  # never into the engine: the request gets the reason
                return False, f"validate: internal error ({type(exc).__name__}: {exc})"[:300]

        return PendingValidation(self._pool.submit(run), time.monotonic() + self.timeout_s)

    def answer(self, pending: PendingValidation) -> Verdict | None:
        """The verdict once ready; past the deadline, a refusal; else None (not yet)."""
        if pending.future.done():
            return pending.future.result()
        if time.monotonic() < pending.deadline:
            return None
        self.timeouts += 1
        if pending.future.running():  # stuck: later validations must not queue behind it
            self._pool.shutdown(wait=False)
            self._pool = self._new_pool()
        pending.future.cancel()
        return False, f"output validation did not finish within {self.timeout_s:g} s"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
