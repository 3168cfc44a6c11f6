"""OpenAI's Files API (`Ingress` binds the routes): a tenant uploads JSONL for batches as the
`openai` client sends it (multipart/form-data, fields `file` and `purpose`), lists, reads and
deletes its own files; another tenant's id is a 404 for every verb (services/batches/files.py).

An upload is read within a byte cap and a time limit like any body (deployments/edge.py), parsed
with python-multipart's parser (what FastAPI uses) on those bytes, and checked off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from deployments.answers import ApiError
from deployments.edge import read_raw
from deployments.service_config import ServiceConfig
from grammar_registry.registrations import RegistrationError
from services import settings
from services.batches.files import PURPOSES, FileError, FileStore, open_blobs
from services.batches.jobs import page

if TYPE_CHECKING:
    from deployments.gate import Gate

FORM_SLACK = 64 << 10  # the form's own bytes around the file (boundaries, headers, purpose)


def file_store(config: ServiceConfig, redis: Any) -> FileStore:
    files = config.files
    where = files.store or str(settings.cache_dir() / "files")
    return FileStore(redis, open_blobs(where, files.store_options), files.caps)


def form_fields(raw: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """name -> (filename, bytes) of a multipart/form-data body; 400 when it is not one."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data" or b"boundary" not in params:
        raise ApiError(400, "file: send multipart/form-data with `file` and `purpose`", "file")
    fields: dict[str, tuple[str | None, bytes]] = {}
    part: dict[str, Any] = {}
    header: list[bytes] = [b"", b""]

    def on_part_begin() -> None:
        part.clear()
        part.update(headers={}, data=[])

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        part["headers"][header[0].lower()] = header[1]
        header[0] = header[1] = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        part["data"].append(data[start:end])

    def on_part_end() -> None:
        _, disposition = parse_options_header(part["headers"].get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("utf-8", "replace")
        filename = disposition.get(b"filename")
        fields[name] = (
            filename.decode("utf-8", "replace") if filename is not None else None,
            b"".join(part["data"]),
        )

    callbacks: Any = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    try:
        parser = MultipartParser(params[b"boundary"], callbacks)
        parser.write(raw)
        parser.finalize()
    except Exception as exc:  # the parser's errors name the byte: the client's
        raise ApiError(400, f"file: not a valid multipart body ({exc})"[:300], "file") from exc
    return fields


async def store_call(fn: Any, *args: Any) -> Any:
    """A store call off the event loop; its errors as HTTP errors naming their field."""
    try:
        return await asyncio.to_thread(fn, *args)
    except FileError as exc:
        reason = "files_cap" if exc.status == 429 else None
        raise ApiError(exc.status, str(exc), exc.field, reason=reason) from exc
    except RegistrationError as exc:
        raise ApiError(exc.status, str(exc), retry_after=2) from exc


# -- the routes ----------------------------------------------------------------------------------


async def upload(gate: Gate, store: FileStore, config: ServiceConfig, request: Any) -> Response:
    async with gate.metered(request) as tenant:
        limit = store.caps.max_file_bytes + FORM_SLACK
        raw = await read_raw(request, limit, config.files.upload_timeout_s)
        fields = form_fields(raw, request.headers.get("content-type", ""))
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose: {purpose[:40]!r}; one of {list(PURPOSES)}", "purpose")
        if "file" not in fields:
            raise ApiError(400, "file: missing (a form field named `file`)", "file")
        filename, data = fields["file"]
        record = await store_call(store.add, tenant, filename or "upload.jsonl", purpose, data)
    return JSONResponse(record.view())


async def listed(gate: Gate, store: FileStore, request: Any) -> Response:
    async with gate.metered(request) as tenant:
        q = request.query_params
        records = await store_call(store.list, tenant, q.get("purpose"))
    page_of = page(records, q.get("after"), limit_of(q.get("limit"), 10_000, 10_000))
    return JSONResponse(page_of)


async def one(gate: Gate, store: FileStore, request: Any, file_id: str) -> Response:
    async with gate.metered(request) as tenant:
        record = await store_call(store.get, tenant, file_id)
    return JSONResponse(record.view())


async def content(gate: Gate, store: FileStore, request: Any, file_id: str) -> Response:
    async with gate.metered(request) as tenant:
        data = await store_call(store.content, tenant, file_id)
    return Response(data, media_type="application/jsonl")


async def delete(gate: Gate, store: FileStore, request: Any, file_id: str) -> Response:
    async with gate.metered(request) as tenant:
        await store_call(store.delete, tenant, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def limit_of(raw: str | None, default: int, cap: int) -> int:
    """A list route's `limit`: 400 unless an integer from 1 to `cap`."""
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= cap:
        raise ApiError(400, f"limit: an integer from 1 to {cap}", "limit")
    return int(raw)
