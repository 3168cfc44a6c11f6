"""JSON validation against a tenant's schema, where it cannot freeze anything.

The schema is the tenant's: it may hold keywords the grammar does not enforce (`not`, `if`/`then`,
`pattern` inside them, unresolvable `$ref`s). `jsonschema-rs` (Rust) runs patterns without
catastrophic backtracking and agrees with every MaskBench label when formats are checked, but it
holds the GIL while it validates, and in-place applicators chained through `$ref`s cost it 2^N
subschema visits (31 `$defs`, each `if` and `then` naming the next: minutes). So validation runs
in `validate` worker processes (sandbox/pool.py) that a deadline kills; `SchemaValidator` is the
caller's side. `workers=0` validates in the calling process (the plain twin, no deadline).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jsonschema_rs

from services.sandbox.pool import LazyPool

Verdict = tuple[bool, str | None]  # (validated, why not)
# a verdict and, when the output is JSON that fails, the failing value's path in it (its keys
# and indices: checked decoding rolls back to where that value starts)
Located = tuple[bool, str | None, list[str | int] | None]
Check = tuple[str, str]  # (the schema as JSON text, the output text)
VALIDATORS_KEPT = 64  # per worker: built once per schema, most recently used kept


def first_line(exc: Any) -> str:
    text = str(getattr(exc, "message", None) or exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def never_fetch(uri: str) -> Any:
    """jsonschema-rs's retriever: its default fetches a remote `$ref` over HTTP, which would let a
    tenant's schema make requests from inside the cluster to any address it names."""
    raise ValueError(f"a remote $ref is not fetched ({uri[:200]})")


class Validators:
    """Validators built from schema texts, the most recently used kept; a schema that cannot be
    used is remembered as its exception (the next output is refused as quickly)."""

    def __init__(self, keep: int = VALIDATORS_KEPT) -> None:
        self._keep = keep
        self._built: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def verdict(self, schema: str, text: str) -> Verdict:
        ok, why, _ = self.located(schema, text)
        return ok, why

    def located(self, schema: str, text: str) -> Located:
        """The verdict, with the path of the value that failed (None when none can be named)."""
        try:
            validator = self._validator(schema)
        except ValueError as exc:
            return False, f"schema could not be used to validate: {exc}", None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return False, f"output failed validation: not JSON ({first_line(exc)})", None
        error = next(iter(validator.iter_errors(value)), None)
        if error is None:
            return True, None, None
        at = [p if isinstance(p, int) else str(p) for p in error.instance_path]
        keyword = str(error.schema_path[-1]) if error.schema_path else "schema"
        where = "".join(f"/{p}" for p in at) or "/"
        return False, f"output failed validation: {first_line(error)} ({keyword} at {where})", at

    def _validator(self, schema: str) -> Any:
        key = hashlib.sha256(schema.encode()).hexdigest()
        with self._lock:
            built = self._built.get(key)
            if built is not None:
                self._built.move_to_end(key)
        if built is None:
            try:
                built = jsonschema_rs.validator_for(
                    json.loads(schema), validate_formats=True, retriever=never_fetch
                )
            except Exception as exc:  # unresolvable $ref, an invalid keyword value, ...
                built = exc
            with self._lock:
                self._built[key] = built
                while len(self._built) > self._keep:
                    self._built.popitem(last=False)
        if isinstance(built, Exception):
            raise ValueError(first_line(built)) from built
        return built


def handler(setup: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The `validate` role (sandbox/worker.py): a job is `checks`, a list of (schema, text)."""
    validators = Validators()

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "verdicts": [validators.located(s, t) for s, t in job["checks"]]}

    return handle


def schema_text(schema: dict[str, Any]) -> str:
    """A schema as the JSON text a validator is built from (and keyed by)."""
    return json.dumps(schema, separators=(",", ":"), sort_keys=True)


class SchemaValidator:
    """`check` validates outputs against their schemas in a worker within `timeout_s`, waiting up
    to `wait_s` for a free worker (started on first use). A worker that runs past the deadline is
    killed, its restart charged to the tenant whose check it was; two workers or more keep one
    for tenants with nothing in flight."""

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 1.0,
        wait_s: float = 30.0,
        memory_bytes: int = 1 << 30,
    ) -> None:
        self.workers, self.timeout_s, self.wait_s = workers, timeout_s, wait_s
        self._pool = LazyPool("validate", {}, workers, memory_bytes)
        self._local = Validators() if workers == 0 else None

    def check(self, checks: Sequence[Check], tenant: str = "default") -> list[Verdict]:
        """One verdict per (schema, text); blocks for at most `wait_s` + `timeout_s`."""
        return [(ok, why) for ok, why, _ in self.locate(checks, tenant)]

    def locate(self, checks: Sequence[Check], tenant: str = "default") -> list[Located]:
        """`check`, each failure with the path of the value that failed where there is one."""
        if self._local is not None:
            return [self._local.located(s, t) for s, t in checks]
        out = self._pool.run({"checks": list(checks)}, self.timeout_s, self.wait_s, tenant)
        if out.get("ok"):
            return [(bool(ok), why, at) for ok, why, at in out["verdicts"]]
        if out.get("reason") == "timeout":
            why = f"output validation did not finish within {self.timeout_s:g} s"
        else:
            why = f"output validation failed: {out.get('error', 'no worker')}"[:300]
        return [(False, why, None)] * len(checks)

    def close(self) -> None:
        self._pool.close()
