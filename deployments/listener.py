"""The ingress replica answering HTTP itself (`ingress.listener: own`, the default).

Through Ray Serve's proxy every request, and every SSE chunk of its answer, crosses one more
process: client → proxy → ingress replica → LLM replica and back. On two cores that hop cost a
third of the service's throughput at 32 streams (benchmarks/serving.py: 0.70 of the engine
in-process through the proxy, 0.96 with the ingress answering directly). Here the ingress replica
runs its own uvicorn server on the ingress port, on the replica's own event loop (the loop its
handles, Redis clients and route handlers already use), serving the same FastAPI app the proxy
would reach. Several ingress replicas on one machine share the port (SO_REUSEPORT: the kernel
spreads connections; only processes of the same user may join it).

What the proxy did that this keeps: a client that hangs up cancels its request (streamed or not,
before or after its first byte), and `X-Request-Id` is echoed (or made). `ingress.listener:
proxy` is the plain twin: Ray's proxy on the same port, as the Helm chart runs it (KubeRay's
Service targets the proxy on every node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


def cancel_on_disconnect(app: Any) -> Any:
    """`app` run as a task that a client's hang-up cancels, as Ray's proxy cancels a replica's
    request. The client's messages are read by a pump (the app reads them from a queue), so a
    disconnect is seen even while the app awaits something else (a queued request's first
    token); and each response carries `x-request-id`."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()
        # bounded: a body is read ahead of the app by a few chunks at most (it counts the bytes)
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=4)
        done = hung_up = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal done
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-request-id", given)]
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                done = True
            await send(message)

        task = asyncio.ensure_future(app(scope, inbox.get, send_with_id))

        async def pump() -> None:
            nonlocal hung_up
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not done:  # the server also says so after a response is complete
                        hung_up = True
                        task.cancel()
                    return
                await inbox.put(message)

        pumping = asyncio.ensure_future(pump())
        try:
            await task
        except asyncio.CancelledError:
            if not hung_up:  # the server is stopping: not ours to swallow
                raise
        finally:
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pumping

    return wrapped


class OwnListener:
    """uvicorn on `host:port`, started on the running event loop; `close` stops accepting and
    lets the answers in flight finish (at most `grace_s`: within the 30 s Ray gives a stopping
    replica, deployments/app.py)."""

    def __init__(self, app: Any, host: str, port: int, grace_s: int = 25) -> None:
        loop = asyncio.get_running_loop()  # the replica's: its constructor runs on it
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(
                exc.errno,
                f"ingress.port: cannot listen on {host}:{port} ({exc.strerror}): another "
                "server holds it; stop it, or choose another port (`structserve serve --port`, "
                "or ingress.port in the config)",
            ) from exc
        sock.listen(2048)
        sock.setblocking(False)
        self.port: int = sock.getsockname()[1]
        config = uvicorn.Config(
            cancel_on_disconnect(app),
            lifespan="off",  # the replica's constructor did the start-up work
            access_log=False,  # each completion logs its own line (deployments/observe.py)
            log_level="warning",
            timeout_graceful_shutdown=grace_s,
        )
        self.server = uvicorn.Server(config)
        # signals stay Ray's: uvicorn installs handlers only on the main thread, and a replica's
        # user code runs on a thread of its own
        self.task = loop.create_task(self.server.serve(sockets=[sock]))
        log.info("ingress listening on %s:%d", host, self.port)

    async def close(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def start(app: Any, host: str, port: int, listener: str) -> OwnListener | None:
    """The ingress replica's own listener when the config asks for one (in its constructor,
    which Ray runs on the replica's event loop)."""
    return OwnListener(app, host, port) if listener == "own" else None
