"""What arrives at the ingress before any work: headers a client may not send, the body (bounded
in bytes and in time), and a streamed answer that releases its tenant's slots however it ends.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Callable, Mapping
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from deployments.answers import ApiError

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


async def read_body(request: Any, model: type[BaseModel], limit: int, timeout_s: float) -> Any:
    """The body validated against `model`; counted as it arrives (no unbounded buffer): 413
    above `limit` bytes, 408 when it has not all arrived within `timeout_s`, 400 naming the first
    invalid field."""
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
    try:
        return model.model_validate_json(b"".join(chunks))
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
