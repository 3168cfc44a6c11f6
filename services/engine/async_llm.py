"""`AsyncLLM`: the engine loop on a background thread, streaming deltas to asyncio callers.

The serving layer uses it: `stream = llm.add_request(prompt, params)`, then `async for out in
stream` yields `RequestOutput`s whose `delta_text`/`delta_token_ids` hold what is new; the last has
`finished=True`. Leaving the loop early aborts the request and frees its pages.

The engine thread admits each request inside a copy of the caller's `contextvars` context, so
code on the admission path (a grammar provider starting a trace span) sees the caller's context.

Prompts are templated and tokenized by `encode` (services/engine/encoding.py) off the event
loop and the engine thread; `check_alive` fails when encodes stop making progress. A step that
fails as a whole has already failed every request (each stream gets its error output); the loop
then goes on, unless the fault was the engine's own (out of memory, the device), when it stops
and every stream, and every request still arriving, gets `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.engine.encoding import Encoder
from services.engine.engine import LLMEngine, Prompt
from services.engine.failures import is_engine_fault
from services.engine.params import RequestOutput, SamplingParams
from services.lora.manager import LoRARequest

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every open stream receives this."""


class RequestStream:
    def __init__(self, owner: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._done = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            log.debug("stream %s: its event loop is closed", self.request_id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._done:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                self._done = item.finished
                yield item
        finally:
            if not self._done:  # the caller left early (disconnect, cancellation)
                self._owner.abort(self.request_id)


@dataclass
class _Add:
    prompt: Prompt
    params: SamplingParams
    stream: RequestStream
    tenant: str = "default"
    context: contextvars.Context | None = None  # the caller's, for the admission path
    lora: LoRARequest | None = None


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | str | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._error: BaseException | None = None
        self._counter = 0
        self._lock = threading.Lock()
        self.encoder = Encoder(engine)
        self._thread = threading.Thread(target=self._run, name="structserve-engine", daemon=True)
        self._thread.start()

    @property
    def front(self) -> LLMEngine:
        """What the replica reads of the model: tokenizer, limits (encoding.Front's names)."""
        return self.engine

    async def wait_ready(self, timeout_s: float) -> None:
        """Ready at once: the engine is in this process (the core process's client waits)."""

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        tenant: str = "default",
        lora: LoRARequest | None = None,
    ) -> RequestStream:
        """Queues a request (on adapter `lora`); must be called from a running event loop."""
        with self._lock:  # against the loop stopping in between: nobody would answer it
            if self._error is not None:
                raise EngineDeadError("the engine loop has stopped") from self._error
            self._counter += 1
            request_id = request_id or f"async-{self._counter}"
            stream = RequestStream(self, request_id, asyncio.get_running_loop())
            context = contextvars.copy_context()
            self._commands.put(_Add(prompt, params, stream, tenant, context, lora))
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(prompt, params, request_id):
            yield out

    def check_alive(self) -> None:
        """Raises `EngineDeadError` once the engine loop has stopped, or when prompts can no
        longer be encoded (for health checks)."""
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError("the engine loop has stopped") from self._error
        if stalled := self.encoder.stalled():
            raise EngineDeadError(f"prompts cannot be encoded: {stalled}")

    def abort(self, request_id: str) -> None:
        self._commands.put(request_id)

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)
        self.encoder.shutdown()
        self.engine.grammars.shutdown()

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain_commands(block=not self.engine.has_unfinished()):
                self._step()
        except BaseException as exc:  # the loop must not die silently: fail every stream
            log.exception("engine loop stopped")
            self._stop(exc)

    def _step(self) -> None:
        try:
            updated = self.engine.step()
        except Exception as exc:
            fatal = is_engine_fault(exc)
            if fatal:  # dead before anyone hears of it: later requests are refused at once
                with self._lock:
                    self._error = exc
            # `step` failed every request already: each stream gets its error output
            for rid in list(self._streams):
                self._deliver(rid)
            if fatal:
                raise
            log.exception("engine step failed; its requests were failed, the loop goes on")
            return
        for req in updated:
            self._deliver(req.request_id)

    def _stop(self, exc: BaseException) -> None:
        with self._lock:
            self._error = self._error or exc
            pending = []
            while True:  # adds queued before the error was set: answered here, never dropped
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        dead = EngineDeadError(f"engine loop failed: {exc!r}")
        for stream in list(self._streams.values()):
            stream.put(dead)
        self._streams.clear()
        for cmd in pending:
            if isinstance(cmd, _Add):
                cmd.stream.put(dead)

    def _drain_commands(self, block: bool) -> bool:
        """Applies queued adds and aborts; False when asked to stop."""
        try:
            cmd = self._commands.get(block=block)
            while True:
                if cmd is None:
                    return False
                self._apply(cmd)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, cmd: _Add | str) -> None:
        if isinstance(cmd, str):
            if cmd in self._streams:
                self.engine.abort(cmd)
                self._deliver(cmd)
            return
        rid = cmd.stream.request_id
        add = self.engine.add_request
        try:
            if cmd.context is not None:
                req = cmd.context.run(add, cmd.prompt, cmd.params, rid, cmd.tenant, cmd.lora)
            else:
                req = add(cmd.prompt, cmd.params, rid, cmd.tenant, cmd.lora)
        except Exception as exc:  # one bad request fails alone, never the loop
            cmd.stream.put(exc if isinstance(exc, ValueError) else ValueError(repr(exc)))
            return
        self._streams[rid] = cmd.stream
        if req.finished:  # refused at admission: the reason is in warnings
            self._deliver(rid)

    def _deliver(self, request_id: str) -> None:
        req = self.engine.requests.get(request_id)
        stream = self._streams.get(request_id)
        if req is None or stream is None or req.held:  # held: nothing of it may go out yet
            return
        out = self.engine.contained_output(req)
        stream.put(out)
        if out.finished:
            del self._streams[request_id]
            self.engine.release(request_id)
