"""Futures for callers that share one piece of work: each caller gets a future of its own,
chained to the shared one, so that cancelling it (the caller stopped waiting) never cancels the
work for the others."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

T = TypeVar("T")
U = TypeVar("U")


def pipe(src: Future[T], dst: Future[U], fn: Callable[[T], U] | None = None) -> None:
    """Once `src` is done, `dst` gets `fn` of its result (the result itself without `fn`), its
    failure, or its cancellation."""

    def forward(f: Future[T]) -> None:
        if f.cancelled():
            dst.cancel()
            return
        exc = f.exception()
        if exc is not None:
            settle(dst, exc=exc)
            return
        try:
            value = fn(f.result()) if fn is not None else f.result()
        except Exception as err:
            settle(dst, exc=err)
            return
        settle(dst, value)

    src.add_done_callback(forward)


def then(inner: Future[T], fn: Callable[[T], U]) -> Future[U]:
    """`fn` of `inner`'s result, as a future whose cancellation cancels `inner`."""
    out: Future[U] = Future()
    pipe(inner, out, fn)
    out.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
    return out


def settle(fut: Future[Any], value: Any = None, exc: BaseException | None = None) -> None:
    try:
        if exc is None:
            fut.set_result(value)
        else:
            fut.set_exception(exc)
    except InvalidStateError:  # its caller cancelled it meanwhile: nobody listens
        pass


def done(value: T) -> Future[T]:
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def failed(exc: BaseException) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_exception(exc)
    return fut
