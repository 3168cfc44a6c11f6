"""What arrives at the ingress before any work: headers a client may not send, the body (bounded
in bytes and in time), and a streamed answer that releases its tenant's slots however it ends.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.answers import ApiError, error_response

# Ray Serve's proxy reads these per request: a client could lift the request timeout or keep its
# generation running after it hangs up (an abort storm that costs nothing to send). The proxy has
# read them before our code runs, so a request carrying one is refused before any work.
RAY_CONTROL_HEADERS = ("x-request-timeout-seconds", "x-request-disconnect-disabled")


def refuse_control_headers(headers: Mapping[str, str]) -> None:
    for name in RAY_CONTROL_HEADERS:
        if name in headers:
            raise ApiError(400, f"header {name}: reserved for the service; do not send it", name)


def check_metrics_token(token: str | None, authorization: str | None) -> None:
    """`/metrics` names tenants and their traffic: with a token set, only its holder reads it."""
    if token is None:
        return
    presented = (authorization or "")[7:].strip() if authorization else ""
    if not (authorization or "").lower().startswith("bearer ") or not hmac.compare_digest(
        presented.encode(), token.encode()
    ):
        raise ApiError(401, "metrics: send `Authorization: Bearer <metrics token>`")


class _Messages(msgspec.Struct):
    """Only the length of a body's `messages`: each one is left as its raw bytes."""

    messages: list[msgspec.Raw] | None = None


_COUNT_MESSAGES = msgspec.json.Decoder(_Messages)


@dataclass(frozen=True)
class BodyLimits:
    """What a body may hold, checked before pydantic builds anything from it."""

    max_bytes: int
    timeout_s: float
    max_depth: int = 128
    max_values: int = 1 << 18
    max_messages: int = 2048


def screen(raw: bytes, lim: BodyLimits) -> None:
    """400 for a body with more than `max_messages` messages, nested past `max_depth` or with
    more than `max_values` JSON values: a cost pydantic (and every walk after it) would pay in
    full before refusing. The messages are counted first, without building them (msgspec
    leaves each one as raw bytes: far cheaper than parsing a body of many). Text that is not
    JSON passes: pydantic's error names what is wrong."""
    try:
        counted = _COUNT_MESSAGES.decode(raw).messages
    except (msgspec.DecodeError, RecursionError):  # not JSON, not a list: pydantic says so
        counted = None
    if counted is not None and len(counted) > lim.max_messages:
        raise ApiError(400, f"messages: at most {lim.max_messages} messages", "messages")
    try:
        value = json.loads(raw)
    except RecursionError as exc:
        raise ApiError(400, f"body: nested deeper than {lim.max_depth} levels") from exc
    except ValueError:
        return
    stack, count = [(value, 1)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > lim.max_depth:
            raise ApiError(400, f"body: nested deeper than {lim.max_depth} levels")
        if count > lim.max_values:
            raise ApiError(400, f"body: more than {lim.max_values} JSON values")
        if isinstance(node, dict | list):
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)


SCREEN_OFF_LOOP_BYTES = 64 << 10  # a body this big is screened and parsed off the event loop


async def read_raw(request: Any, limit: int, timeout_s: float) -> bytes:
    """The body's bytes, counted as they arrive (no unbounded buffer): 413 above `limit`, 408
    when it has not all arrived within `timeout_s`."""
    if int(request.headers.get("content-length") or 0) > limit:
        raise ApiError(413, f"body: larger than {limit} bytes")
    chunks: list[bytes] = []

    async def receive() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"body: larger than {limit} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except TimeoutError as exc:
        raise ApiError(408, f"body: not received within {timeout_s:g} s") from exc
    return b"".join(chunks)


async def read_body(request: Any, model: type[BaseModel], lim: BodyLimits) -> Any:
    """The body validated against `model`; counted as it arrives (no unbounded buffer): 413
    above `max_bytes`, 408 when it has not all arrived within `timeout_s`, 400 for a body past
    the shape limits (`screen`) and naming the first invalid field."""
    raw = await read_raw(request, lim.max_bytes, lim.timeout_s)

    def parse() -> Any:
        screen(raw, lim)
        return model.model_validate_json(raw)

    try:
        if len(raw) < SCREEN_OFF_LOOP_BYTES:
            return parse()
        return await asyncio.to_thread(parse)  # other requests' streams go on meanwhile
    except ValidationError as exc:
        first = exc.errors()[0]
        msg = first["msg"].removeprefix("Value error, ")
        # a check across fields names its field first ("tool_choice: ...")
        named = re.match(r"^([a-z_][\w.]*): ", msg)
        located = ".".join(str(x) for x in first["loc"])
        if not located:
            raise ApiError(400, msg, named.group(1) if named else None) from exc
        raise ApiError(400, f"{located}: {msg}", located) from exc


class ReleasingStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (sent, the client
    gone, cancelled before the first byte), so its `finally` (the tenant's slots, the replicas'
    work) always runs; `backstop` runs after it, for a generator that never started."""

    def __init__(self, events: Any, backstop: Callable[[], object]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._backstop = backstop

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self._backstop()


def openai_errors(app: FastAPI) -> None:
    """Every error in the OpenAI shape: ours, unknown routes and methods (404, 405), and bodies
    FastAPI refuses itself (400 naming the first field)."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, err: ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid body"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return error_response(ApiError(400, message, param))
