"""The ingress replica's own listener (deployments/listener.py) without Ray: a client's hang-up
cancels its request as Ray's proxy would, streamed or not; `X-Request-Id` is echoed or made;
replicas share the port; closing lets an answer in flight finish."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from deployments.listener import OwnListener


def make_app(seen: dict[str, asyncio.Event]) -> Starlette:
    async def slow(request: Request) -> JSONResponse:
        await request.body()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen["slow cancelled"].set()
            raise
        return JSONResponse({})

    async def stream(_request: Request) -> StreamingResponse:
        async def events():
            try:
                await asyncio.sleep(30)  # a queued request: no first token yet
                yield b"data: late\n\n"
            finally:
                seen["stream closed"].set()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def quick(request: Request) -> JSONResponse:
        await asyncio.sleep(float(request.query_params.get("s", "0")))
        return JSONResponse({"body": (await request.body()).decode()})

    routes = [Route("/slow", slow, methods=["POST"]), Route("/stream", stream)]
    return Starlette(routes=[*routes, Route("/quick", quick, methods=["GET", "POST"])])


def events() -> dict[str, asyncio.Event]:
    return {"slow cancelled": asyncio.Event(), "stream closed": asyncio.Event()}


async def hang_up_after(port: int, request: bytes, wait_s: float = 0.3) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    await asyncio.sleep(wait_s)
    writer.close()
    await writer.wait_closed()


def test_a_hang_up_cancels_the_request_streamed_or_not() -> None:
    async def run() -> None:
        seen = events()
        own = OwnListener(make_app(seen), "127.0.0.1", 0)
        await asyncio.sleep(0.1)
        body = b'{"x": 1}'
        post = b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        await hang_up_after(own.port, post)
        await asyncio.wait_for(seen["slow cancelled"].wait(), 5)
        await hang_up_after(own.port, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(seen["stream closed"].wait(), 5)
        await own.close()

    asyncio.run(run())


def test_request_ids_are_echoed_or_made_and_bodies_arrive_whole() -> None:
    async def run() -> None:
        own = OwnListener(make_app(events()), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{own.port}/quick"
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data="a" * 200_000, headers={"X-Request-Id": "t-1"}) as r:
                assert r.status == 200 and r.headers["x-request-id"] == "t-1"
                assert (await r.json())["body"] == "a" * 200_000
            async with s.get(url) as r:
                assert len(r.headers["x-request-id"]) == 32
        await own.close()

    asyncio.run(run())


def test_replicas_share_the_port_and_closing_finishes_answers_in_flight() -> None:
    async def run() -> None:
        first = OwnListener(make_app(events()), "127.0.0.1", 0)
        second = OwnListener(make_app(events()), "127.0.0.1", first.port)  # SO_REUSEPORT
        url = f"http://127.0.0.1:{first.port}/quick"
        async with aiohttp.ClientSession() as s:
            in_flight = asyncio.ensure_future(s.get(url + "?s=0.5"))
            await asyncio.sleep(0.2)
            await asyncio.gather(first.close(), second.close())
            r = await in_flight
            assert r.status == 200
        with socket.socket() as probe:  # nobody listens any more
            assert probe.connect_ex(("127.0.0.1", first.port)) != 0

    asyncio.run(run())


def test_a_port_another_server_holds_is_refused_naming_the_setting() -> None:
    async def run() -> None:
        with socket.socket() as other:  # a server that does not share its port
            other.bind(("127.0.0.1", 0))
            other.listen(1)
            port = other.getsockname()[1]
            with pytest.raises(OSError, match=rf"ingress.port: cannot listen on 127.0.0.1:{port}"):
                OwnListener(make_app(events()), "127.0.0.1", port)

    asyncio.run(run())
