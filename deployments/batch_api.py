"""OpenAI's Batch API routes (`Ingress` binds them): create a batch from a tenant's uploaded
file, read it, list them (paged), cancel one. The work is the runner's
(deployments/batch_runner.py); records and progress live in Redis (services/batches/jobs.py), so
batches need the service's Redis. Another tenant's batch or file id is a 404 for every verb.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deployments.answers import ApiError, error_response
from deployments.edge import screen
from deployments.files_api import limit_of, store_call
from deployments.observe import observe
from deployments.protocol import ChatCompletionRequest, CompletionRequest, new_id
from services.batches.files import FileStore
from services.batches.jobs import ENDPOINTS, FINAL, WINDOWS, BatchStore, CreateBatch, page
from services.engine.fairness import BATCH_SUFFIX

if TYPE_CHECKING:
    from deployments.gate import Gate


ingress_ids = {"chat": "chatcmpl", "completions": "cmpl"}  # as the endpoints name answers


def batch_store(config: Any, redis: Any) -> BatchStore | None:
    """None without Redis: a runner in another process could not see the batches."""
    return None if redis is None else BatchStore(redis, config.batches.caps)


async def _store_call(fn: Any, *args: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args)
    except ApiError:
        raise
    except Exception as exc:  # Redis down: worth a retry
        message = f"batches: the store is unavailable ({type(exc).__name__}); try again"
        raise ApiError(503, message, retry_after=2) from exc


def _need(store: BatchStore | None) -> BatchStore:
    if store is None:
        raise ApiError(503, "batches: this service runs without Redis (redis_url)")
    return store


async def _get(store: BatchStore, tenant: str, batch_id: str) -> Any:
    record = await _store_call(store.get, tenant, batch_id)
    if record is None:
        raise ApiError(404, f"batch {batch_id[:100]!r} not found", "batch_id")
    return record


async def create(
    gate: Gate, store: BatchStore | None, files: FileStore, request: Any
) -> JSONResponse:
    async with gate.metered(request) as tenant:
        jobs = _need(store)
        body = await gate.body(request, CreateBatch)
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint: one of {list(ENDPOINTS)}", "endpoint")
        if body.completion_window not in WINDOWS:
            raise ApiError(400, f"completion_window: one of {list(WINDOWS)}", "completion_window")
        try:  # another tenant's file: the same 404 as none
            record = await store_call(files.get, tenant, body.input_file_id)
        except ApiError as exc:
            exc.param = "input_file_id"
            raise
        if record.purpose != "batch":
            raise ApiError(400, "input_file_id: not a file uploaded for a batch", "input_file_id")
        if record.lines > jobs.caps.max_lines:
            cap = jobs.caps.max_lines
            raise ApiError(400, f"input_file_id: {record.lines} lines, over {cap}", "input_file_id")
        if await _store_call(jobs.in_flight, tenant) >= jobs.caps.max_in_flight:
            cap = jobs.caps.max_in_flight
            raise ApiError(429, f"batches: {cap} in flight already", reason="batches_cap")
        made = await _store_call(jobs.create, tenant, body, record.lines)
    return JSONResponse(made.model_dump())


async def retrieve(gate: Gate, store: BatchStore | None, request: Any, batch_id: str) -> Any:
    async with gate.metered(request) as tenant:
        record = await _get(_need(store), tenant, batch_id)
    return JSONResponse(record.model_dump())


async def listed(gate: Gate, store: BatchStore | None, request: Any) -> JSONResponse:
    async with gate.metered(request) as tenant:
        records = await _store_call(_need(store).list, tenant)
    q = request.query_params
    return JSONResponse(page(records, q.get("after"), limit_of(q.get("limit"), 20, 100)))


async def cancel(gate: Gate, store: BatchStore | None, request: Any, batch_id: str) -> Any:
    """Stops new lines at once (the runner checks before each); the finished ones are kept
    and the batch ends `cancelled` with its partial output."""
    async with gate.metered(request) as tenant:
        jobs = _need(store)
        await _get(jobs, tenant, batch_id)  # 404 first
        record = await _store_call(jobs.update, tenant, batch_id, _cancelling)
        if record.status in FINAL and record.status != "cancelled":
            raise ApiError(409, f"batch {batch_id!r} is already {record.status}", "batch_id")
    return JSONResponse(record.model_dump())


def _cancelling(record: Any) -> None:
    if record.status not in FINAL and record.status != "cancelling":
        record.status, record.cancelling_at = "cancelling", int(time.time())


async def line(ingress: Any, tenant: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """One line of `tenant`'s batch (deployments/batch_runner.py), answered as its endpoint
    answers a request, whole (no stream), within the tenant's tokens per minute, its rows in the
    engine's batch class (services/engine/fairness.py: what interactive requests leave).
    `{"status", "body", "request_id"}`; a 429 or 503 says when to try again (`retry_after`)."""
    obs = observe(kind, {})
    obs.tenant, obs.engine_tenant = tenant, tenant + BATCH_SUFFIX
    rid = new_id(ingress_ids[kind], None)
    try:
        # the tenant's tokens per minute, not its concurrency or requests per minute: the runner
        # bounds the lines in flight, and a running batch never turns its interactive requests
        # away
        lease = await ingress.gate.admit(tenant, tokens_only=True)
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:  # the shape limits a request's body meets (edge.screen), then its model
            screen(json.dumps(body).encode(), ingress.gate.body_limits)
            parsed = model.model_validate({**body, "stream": False})
        except ApiError:
            ingress.tenants.release(lease)
            raise
        except ValidationError as exc:
            ingress.tenants.release(lease)
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ApiError(400, f"{where}: {first['msg']}", where) from exc
        response = await ingress._answer(obs, kind, lease, parsed, None, rid)
    except ApiError as err:
        obs.finish(err.status, err)
        error = error_response(err)
        retry = error.headers.get("retry-after")
        out = {"status": err.status, "body": json.loads(bytes(error.body)), "request_id": rid}
        return out | ({"retry_after": float(retry)} if retry else {})
    obs.finish(200)
    return {"status": 200, "body": json.loads(bytes(response.body)), "request_id": rid}
