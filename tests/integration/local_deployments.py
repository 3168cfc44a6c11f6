"""The service's deployment classes in this process, joined by stand-ins for Ray Serve's handles.

For tests that need to see inside every deployment at once (the SDK's in-memory span exporter and
metric reader only see this process). Like a replica actor, each target runs on its own event-loop
thread; arguments and results are pickled across, as Ray does; a streaming call is driven to its
end by the target's side (as Serve's replica does), whether the caller reads on or not.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from typing import Any

from starlette.requests import Request


def _loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="local-replica", daemon=True).start()
    return loop


class LocalHandle:
    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.target = target
        self.loop = loop or _loop()
        self._stream = False

    def options(self, stream: bool = False) -> LocalHandle:
        view = LocalHandle(self.target, self.loop)
        view._stream = stream
        return view

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class _Method:
    def __init__(self, handle: LocalHandle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
        fn = getattr(self.handle.target, self.name)
        if self.handle._stream:
            return _Stream(self.handle.loop, fn(*args, **kwargs))
        fut = asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self.handle.loop)
        return _Response(fut)


class _Response:
    def __init__(self, fut: Any) -> None:
        self.fut = fut

    def result(self, timeout_s: float | None = None) -> Any:
        return pickle.loads(pickle.dumps(self.fut.result(timeout_s)))

    def __await__(self) -> Any:
        return asyncio.wrap_future(self.fut).__await__()


class _Stream:
    """The generator runs to its end on the target's loop; items wait in a queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, agen: Any) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.consumer = asyncio.get_running_loop()
        self.task = asyncio.run_coroutine_threadsafe(self._pump(agen), loop)

    async def _pump(self, agen: Any) -> None:
        try:
            async for item in agen:
                self.consumer.call_soon_threadsafe(self.queue.put_nowait, pickle.dumps(item))
            self.consumer.call_soon_threadsafe(self.queue.put_nowait, StopAsyncIteration())
        except BaseException as exc:
            self.consumer.call_soon_threadsafe(self.queue.put_nowait, exc)
            raise

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return pickle.loads(item)

    def cancel(self) -> None:
        self.task.cancel()


def http_request(
    body: dict[str, Any], key: str, path: str = "/v1/chat/completions", **headers: str
) -> Request:
    """A POST as the ingress receives it from Serve's proxy."""
    raw = json.dumps(body).encode()
    pairs = [
        (b"authorization", f"Bearer {key}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in headers.items()),
    ]
    scope = {"type": "http", "method": "POST", "path": path, "headers": pairs, "query_string": b""}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


def plain_ingress_class() -> type:
    """The class under `@serve.ingress` (the wrapper needs a running Serve replica)."""
    from deployments.ingress import Ingress

    return Ingress.__mro__[1]
