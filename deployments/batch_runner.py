"""The batch runner: a Ray Serve deployment that runs tenants' batches in the engines' idle
capacity, and loses no line.

It takes a batch from the Redis queue under a lease (renewed while it works; a runner killed
mid-batch lets it lapse and the batch is taken up again, by its restarted replica or another),
reads the input file, writes the lines that cannot run to the error file, and sends the rest to
the ingress (`Ingress.batch_line`, through its handle: the same checks, limits and answers as a
request to the endpoint) with `concurrency` in flight. Lines that share a grammar or a system
prompt are sent together (sorted by them), so a schema compiles once and the prefix cache serves
the rest. In the engine the lines are the tenant's batch class (services/engine/fairness.py):
they get what interactive requests leave. A line refused for the tenant's limits or a busy
replica (429, 503) waits and is sent again; any other answer is its output or its error.

Each line's output is appended and marked done in one step (services/batches/jobs.py), so a
line is written once even when it ran twice. Cancel and the window's end stop new lines; the
batch ends with its partial output.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from deployments.grammar_service import redis_client
from deployments.service_config import ServiceConfig
from services.batches.files import FileError
from services.batches.jobs import (
    FINAL,
    QUEUE,
    BatchRecord,
    Line,
    error_line,
    output_line,
    read_lines,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = (429, 503)
POLL_S = 1.0


def grouping(line: Line) -> str:
    """What lines that should run together share: their grammar, then their first message."""
    body = line.body
    fmt = body.get("response_format") or body.get("structured_outputs") or body.get("tools")
    first = (body.get("messages") or [None])[0] if "messages" in body else body.get("prompt")
    return json.dumps([fmt, first], sort_keys=True, default=str)[:4096]


class BatchRunner:
    def __init__(self, config: dict[str, Any], app_name: str | None = None) -> None:
        cfg = ServiceConfig.model_validate(config)
        from deployments.batch_api import batch_store
        from deployments.files_api import file_store

        self.config = cfg.batches
        self.redis: Any = redis_client(cfg.redis_url)
        self.store = batch_store(cfg, self.redis)
        self.files = file_store(cfg, self.redis)
        self.app_name = app_name
        self._ingress: Any = None
        self.stopping = False
        if self.store is not None:  # batches need Redis: without it there are none to run
            threading.Thread(target=self._thread, name="batch-runner", daemon=True).start()

    def _thread(self) -> None:
        asyncio.run(self._loop())

    def ingress(self) -> Any:
        if self._ingress is None:
            from ray import serve

            app = self.app_name or serve.get_replica_context().app_name
            self._ingress = serve.get_deployment_handle("Ingress", app_name=app)
        return self._ingress

    async def check_health(self) -> None:
        return None

    def __del__(self) -> None:
        self.stopping = True

    # -- taking batches ------------------------------------------------------------------------

    async def _loop(self) -> None:
        while not self.stopping:
            try:
                ran = await self._take_one()
            except Exception:
                log.exception("batch runner: a pass failed; trying again")
                ran = False
            if not ran:
                await asyncio.sleep(POLL_S)

    async def _take_one(self) -> bool:
        """Runs the first queued batch whose lease it gets; False when there was none."""
        assert self.store is not None
        for raw in await asyncio.to_thread(self.redis.lrange, QUEUE, 0, -1):
            item = raw.decode()
            tenant, _, batch_id = item.partition("/")
            lease = f"structserve:batch:{batch_id}:lease"
            if not await asyncio.to_thread(self.redis.set, lease, "1", nx=True, ex=self._lease_s):
                continue
            try:
                await self._run(tenant, batch_id, lease)
            finally:
                await asyncio.to_thread(self.redis.delete, lease)
            return True
        return False

    @property
    def _lease_s(self) -> int:
        return int(self.config.lease_s)

    async def _renew(self, lease: str) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            await asyncio.to_thread(self.redis.expire, lease, self._lease_s)

    # -- running one ---------------------------------------------------------------------------

    async def _run(self, tenant: str, batch_id: str, lease: str) -> None:
        assert self.store is not None
        store = self.store
        record = await asyncio.to_thread(store.get, tenant, batch_id)
        if record is None or record.status in FINAL:
            await asyncio.to_thread(self.redis.lrem, QUEUE, 0, f"{tenant}/{batch_id}")
            return
        renew = asyncio.create_task(self._renew(lease))
        try:
            if record.status != "cancelling" and not self._expired(record):
                try:
                    await self._lines(tenant, record)
                except FileError as exc:  # the input file was deleted meanwhile
                    if exc.status >= 500:  # the file store does not answer: try again later
                        raise
                    await asyncio.to_thread(store.update, tenant, batch_id, _failed(str(exc)))
                    await asyncio.to_thread(self.redis.lrem, QUEUE, 0, f"{tenant}/{batch_id}")
                    return
            if not self.stopping:  # else its lease lapses and a runner carries on
                await self._finalize(tenant, batch_id)
        finally:
            renew.cancel()

    async def _lines(self, tenant: str, record: BatchRecord) -> None:
        assert self.store is not None
        store, batch_id = self.store, record.id
        data = await asyncio.to_thread(self.files.content, tenant, record.input_file_id)
        lines, errors = read_lines(data, record.endpoint)
        for e in errors:  # numbered: written once however often this runs
            await asyncio.to_thread(store.finish, batch_id, e["error"]["line"], e, True)
        await asyncio.to_thread(store.update, tenant, batch_id, _in_progress)
        done = await asyncio.to_thread(store.done, batch_id)
        todo = sorted((x for x in lines if x.number not in done), key=grouping)
        kind = "chat" if record.endpoint.endswith("/chat/completions") else "completions"
        queue: asyncio.Queue[Line] = asyncio.Queue()
        for line in todo:
            queue.put_nowait(line)
        state = {"stop": False, "checked": 0.0}

        async def worker() -> None:
            while not queue.empty() and not await self._stop(tenant, batch_id, state):
                line = queue.get_nowait()
                out, failed = await self._one(tenant, kind, line)
                await asyncio.to_thread(store.finish, batch_id, line.number, out, failed)

        await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))

    async def _stop(self, tenant: str, batch_id: str, state: dict[str, Any]) -> bool:
        """Cancelled or past its window: checked at most every second (one Redis read)."""
        assert self.store is not None
        now = time.monotonic()
        if not state["stop"] and now - state["checked"] >= 1.0:
            state["checked"] = now
            completed, failed = await asyncio.to_thread(self.store.counts, batch_id)

            def counted(r: BatchRecord) -> None:  # progress for the batch's readers
                r.request_counts.update(completed=completed, failed=failed)

            record = await asyncio.to_thread(self.store.update, tenant, batch_id, counted)
            state["stop"] = record is None or record.status == "cancelling"
            state["stop"] = state["stop"] or (record is not None and self._expired(record))
        return bool(state["stop"] or self.stopping)

    @staticmethod
    def _expired(record: BatchRecord) -> bool:
        return time.time() >= record.expires_at

    async def _one(self, tenant: str, kind: str, line: Line) -> tuple[dict[str, Any], bool]:
        """The line's output line (or error line, True) from the ingress; waits out 429s and
        503s (the tenant's limits, a busy or restarting replica)."""
        wait = 0.5
        while True:
            try:
                answer = await self.ingress().batch_line.remote(tenant, kind, line.body)
            except Exception as exc:  # the ingress replica died mid-call: send it again
                log.warning("batch line %s: %r; sending it again", line.custom_id, exc)
                answer = {"status": 503, "body": {}, "request_id": ""}
            status = int(answer["status"])
            if status not in RETRY_STATUSES or self.stopping:
                break
            await asyncio.sleep(float(answer.get("retry_after") or wait))
            wait = min(wait * 2, 10.0)
        if status == 200:
            return output_line(line.custom_id, 200, answer["body"], answer["request_id"]), False
        message = (answer["body"].get("error") or {}).get("message", f"status {status}")
        return error_line(line.number, line.custom_id, f"http_{status}", message), True

    async def _finalize(self, tenant: str, batch_id: str) -> None:
        """Writes the output and error files, ends the batch, and drops its progress."""
        assert self.store is not None
        store = self.store
        record = await asyncio.to_thread(store.get, tenant, batch_id)
        if record is None:
            return
        await asyncio.to_thread(store.update, tenant, batch_id, _finalizing)
        files: dict[str, str | None] = {}
        for kind, field in (("out", "output_file_id"), ("err", "error_file_id")):
            data = await asyncio.to_thread(store.outputs, batch_id, kind)
            files[field] = None
            if data:
                name = f"{batch_id}_{'output' if kind == 'out' else 'error'}.jsonl"
                made = await asyncio.to_thread(
                    self.files.add, tenant, name, "batch_output", data, True
                )
                files[field] = made.id
        completed, failed = await asyncio.to_thread(store.counts, batch_id)

        def end(r: BatchRecord) -> None:
            now = int(time.time())
            r.output_file_id, r.error_file_id = files["output_file_id"], files["error_file_id"]
            r.request_counts.update(completed=completed, failed=failed)
            if r.status == "cancelling":
                r.status, r.cancelled_at = "cancelled", now
            elif self._expired(r) and completed + failed < r.request_counts["total"]:
                r.status, r.expired_at = "expired", now
            else:
                r.status, r.completed_at = "completed", now

        await asyncio.to_thread(store.update, tenant, batch_id, end)
        await asyncio.to_thread(store.forget, batch_id)
        await asyncio.to_thread(self.redis.lrem, QUEUE, 0, f"{tenant}/{batch_id}")


def _in_progress(r: BatchRecord) -> None:
    if r.status == "validating":
        r.status, r.in_progress_at = "in_progress", int(time.time())


def _finalizing(r: BatchRecord) -> None:
    r.finalizing_at = r.finalizing_at or int(time.time())


def _failed(message: str) -> Any:
    def fail(r: BatchRecord) -> None:
        r.status, r.failed_at = "failed", int(time.time())
        error = {"code": "input_file", "message": message[:500], "param": "input_file_id"}
        r.errors = {"object": "list", "data": [{**error, "line": None}]}

    return fail
