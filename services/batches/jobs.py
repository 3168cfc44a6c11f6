"""Batches (OpenAI's Batch API): the job records, the queue the runner takes them from, and each
batch's progress, all in Redis so a runner or a replica killed mid-batch loses nothing.

- `structserve:tenant:<tenant>:batches`: id -> the batch object (a tenant's own: another tenant's
  id is absent, a 404);
- `structserve:batches:queue`: `tenant/id` of batches waiting for a runner;
- `structserve:batch:<id>:done` (a set of line numbers) and `:out` / `:err` (lists of output
  lines, in order of completion): a line's output is appended and marked done in one transaction
  (WATCH on the set), so a line finished twice (its runner killed after the work, before the
  mark, or two runners after a lease lapsed) is written once.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOWS = {"24h": 24 * 3600}
FINAL = ("completed", "failed", "expired", "cancelled")
QUEUE = "structserve:batches:queue"


class BatchCaps(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_lines: int = Field(default=50_000, ge=1)  # a batch's
    max_in_flight: int = Field(default=4, ge=1)  # a tenant's batches not yet final


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class BatchRecord(BaseModel):
    """OpenAI's batch object, field for field."""

    id: str
    object: str = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: str = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: dict[str, int] = Field(
        default_factory=lambda: {"total": 0, "completed": 0, "failed": 0}
    )
    metadata: dict[str, str] | None = None

    def view(self) -> dict[str, Any]:
        return self.model_dump()


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as the error file names it
    custom_id: str
    body: dict[str, Any]


def read_lines(data: bytes, endpoint: str) -> tuple[list[Line], list[dict[str, Any]]]:
    """A batch file's lines: those to run, and an error-file line for each that cannot (not
    JSON, no `custom_id`, one repeated, another method or endpoint, no body object)."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except (ValueError, RecursionError):  # nested past the parser's depth: not JSON here
            item = None
        cid = item.get("custom_id") if isinstance(item, dict) else None
        why = _refusal(item, cid, seen, endpoint)
        if why is not None:
            errors.append(error_line(number, cid if isinstance(cid, str) else None, *why))
            continue
        assert isinstance(item, dict) and isinstance(cid, str)
        seen.add(cid)
        lines.append(Line(number, cid, item["body"]))
    return lines, errors


def _refusal(item: Any, cid: Any, seen: set[str], endpoint: str) -> tuple[str, str] | None:
    if not isinstance(item, dict):
        return "invalid_json", "the line is not a JSON object"
    if not isinstance(cid, str) or not cid:
        return "missing_custom_id", "custom_id: a non-empty string is required"
    if cid in seen:
        return "duplicate_custom_id", f"custom_id: {cid[:64]!r} is used by an earlier line"
    if item.get("method", "POST") != "POST":
        return "invalid_method", "method: only POST"
    if item.get("url") != endpoint:
        return "invalid_url", f"url: {str(item.get('url'))[:64]!r}; this batch's is {endpoint}"
    if not isinstance(item.get("body"), dict):
        return "invalid_body", "body: a JSON object is required"
    return None


def error_line(number: int | None, cid: str | None, code: str, message: str) -> dict[str, Any]:
    """An error-file line in OpenAI's shape (`line` added: which input line it was)."""
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": cid,
        "response": None,
        "error": {"code": code, "message": message[:500], "line": number},
    }


def output_line(cid: str, status: int, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": cid,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def page(records: list[Any], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's list page over `records` (newest first, each with `id` and `view()`)."""
    if after is not None:
        ids = [r.id for r in records]
        records = records[ids.index(after) + 1 :] if after in ids else []
    kept = records[:limit]
    return {
        "object": "list",
        "data": [r.view() for r in kept],
        "first_id": kept[0].id if kept else None,
        "last_id": kept[-1].id if kept else None,
        "has_more": len(records) > limit,
    }


class BatchStore:
    """The records and progress on a Redis client (`redis.Redis`; fakeredis in unit tests)."""

    def __init__(self, client: Any, caps: BatchCaps | None = None) -> None:
        self.client = client
        self.caps = caps or BatchCaps()

    @staticmethod
    def _key(tenant: str) -> str:
        return f"structserve:tenant:{tenant}:batches"

    def create(self, tenant: str, body: CreateBatch, total: int) -> BatchRecord:
        now = int(time.time())
        record = BatchRecord(
            id="batch_" + secrets.token_hex(12),
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            created_at=now,
            expires_at=now + WINDOWS[body.completion_window],
            metadata=body.metadata,
        )
        record.request_counts["total"] = total
        self.save(tenant, record)
        self.client.rpush(QUEUE, f"{tenant}/{record.id}")
        return record

    def save(self, tenant: str, record: BatchRecord) -> None:
        self.client.hset(self._key(tenant), record.id, record.model_dump_json())

    def update(
        self, tenant: str, batch_id: str, change: Callable[[BatchRecord], None]
    ) -> BatchRecord | None:
        """`change` applied to the record as it is now, written only if nobody wrote it in
        between (WATCH): the runner's progress never undoes a cancel, nor a cancel a finish."""
        key = self._key(tenant)
        out: list[BatchRecord | None] = [None]

        def apply(pipe: Any) -> None:
            raw = pipe.hget(key, batch_id)
            if raw is None:
                return
            record = BatchRecord.model_validate_json(raw)
            change(record)
            pipe.multi()
            pipe.hset(key, batch_id, record.model_dump_json())
            out[0] = record

        self.client.transaction(apply, key)
        return out[0]

    def get(self, tenant: str, batch_id: str) -> BatchRecord | None:
        raw = self.client.hget(self._key(tenant), batch_id)
        return None if raw is None else BatchRecord.model_validate_json(raw)

    def list(self, tenant: str) -> list[BatchRecord]:
        """Newest first, as OpenAI lists them."""
        rows = self.client.hgetall(self._key(tenant)).values()
        records = [BatchRecord.model_validate_json(v) for v in rows]
        return sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)

    def in_flight(self, tenant: str) -> int:
        return sum(r.status not in FINAL for r in self.list(tenant))

    # -- progress (the runner's) ------------------------------------------------------------

    def finish(self, batch_id: str, number: int, line: dict[str, Any], failed: bool) -> bool:
        """Appends line `number`'s output (or error) once; False when it was done already."""
        done = f"structserve:batch:{batch_id}:done"
        into = f"structserve:batch:{batch_id}:" + ("err" if failed else "out")
        wrote = [False]

        def apply(pipe: Any) -> None:
            if pipe.sismember(done, number):
                return
            pipe.multi()
            pipe.sadd(done, number)
            pipe.rpush(into, json.dumps(line))
            wrote[0] = True

        self.client.transaction(apply, done)
        return wrote[0]

    def done(self, batch_id: str) -> set[int]:
        return {int(n) for n in self.client.smembers(f"structserve:batch:{batch_id}:done")}

    def outputs(self, batch_id: str, kind: str) -> bytes:
        rows = self.client.lrange(f"structserve:batch:{batch_id}:{kind}", 0, -1)
        return b"".join(r + b"\n" for r in rows)

    def counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines so far."""
        out = self.client.llen(f"structserve:batch:{batch_id}:out")
        return int(out), int(self.client.llen(f"structserve:batch:{batch_id}:err"))

    def forget(self, batch_id: str) -> None:
        self.client.delete(*(f"structserve:batch:{batch_id}:{k}" for k in ("done", "out", "err")))
