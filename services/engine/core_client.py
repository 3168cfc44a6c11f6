"""`CoreClient`: `AsyncLLM`'s surface over an engine core in a process of its own (core.py).

The replica keeps what is per request and asynchronous: templating and tokenization (`Encoder`
over a model-less `Front`), each stream's totals, and the grammar service's calls the core
makes (answered on a small pool through `calls`, the replica's `VerdictSource`). Requests cross
as token-id arrays; a dropped stream is one `Abort`.

A watchdog thread watches the core: a process that exits, or a loop silent for longer than
`timeout_s` (it beats at least every core.BEAT_S, between steps and while idle), is killed; every
open stream gets `EngineDeadError` at once, and a new core starts (the model loaded again).
Meanwhile `state` is "restarting": new requests wait for it within their deadline
(`wait_ready`) or get `EngineRestarting` (503, with a retry hint). A core that fails to start
raises `CoreStartError` from the constructor with its own reason; after a crash, a failed
restart leaves `state` "failed" and `check_alive` raising that reason (no hidden crash loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from services import telemetry
from services.engine import core_messages as msg
from services.engine.admission import Prompt
from services.engine.async_llm import EngineDeadError, RequestStream
from services.engine.config import EngineConfig
from services.engine.encoding import Encoder, Front
from services.engine.params import SamplingParams
from services.lora.manager import LoRARequest

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a cold start loads the model (and may convert the default one)
WATCH_S = 0.2


class CoreStartError(RuntimeError):
    """The engine core process could not start; the message is its own reason."""


class EngineRestarting(EngineDeadError):
    """The core is starting again after a crash: try again shortly (503 with Retry-After)."""

    status = 503
    retry_after_s = 5


@dataclass
class _Live:
    stream: RequestStream
    totals: msg.Totals


class _Process:
    """One core process and its end of the socket."""

    def __init__(
        self, config: EngineConfig, grammar: dict[str, Any] | None, settings: Any | None
    ) -> None:
        from services.sandbox.process import PYTHON_FLAGS, SPAWNER, child_env

        env = child_env()  # our code first on its path; the replica's threads, not a worker's
        if "OMP_NUM_THREADS" not in os.environ:
            env.pop("OMP_NUM_THREADS", None)
        mine, theirs = socket.socketpair()
        argv = [sys.executable, *PYTHON_FLAGS, "-m", "services.engine.core"]
        argv += [str(theirs.fileno()), str(os.getpid())]
        try:
            self.proc = SPAWNER.call(  # a thread that lives on: the child's death signal holds
                lambda: subprocess.Popen(
                    argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env
                )
            )
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self.conn.send((config, grammar, settings))
        self.lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: Any) -> None:
        raw = msg.encode(message)
        with self.lock:
            self.conn.send_bytes(raw)

    def ready(self, timeout_s: float) -> msg.Ready:
        """The core's `Ready`; `CoreStartError` with its reason when it fails or goes quiet."""
        if not self.conn.poll(timeout_s):
            self.kill()
            raise CoreStartError(f"the engine core did not start within {timeout_s:g} s")
        try:
            first = msg.decode_from_core(self.conn.recv_bytes())
        except (EOFError, OSError):
            code = self.proc.wait(timeout=10)
            raise CoreStartError(f"the engine core exited while starting (status {code})") from None
        if isinstance(first, msg.Failed):
            self.kill()
            raise CoreStartError(first.error)
        assert isinstance(first, msg.Ready), first
        return first

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.conn.close()


class CoreClient:
    def __init__(
        self,
        config: EngineConfig,
        grammar: dict[str, Any] | None = None,
        calls: Any | None = None,
        timeout_s: float = 30.0,
        start_timeout_s: float = START_TIMEOUT_S,
        telemetry_settings: Any | None = None,
    ) -> None:
        """`grammar`: the replica's grammar provider settings (core.grammar_factory), with
        `calls` answering its verdicts; None: the core compiles grammars itself.
        `telemetry_settings`: the core exports its spans and hands its metrics over
        (`metrics`) as the replica does."""
        self.config, self.grammar, self.calls = config, grammar, calls
        self.telemetry_settings = telemetry_settings
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._lock = threading.Lock()
        self._streams: dict[str, _Live] = {}
        self._counter = 0
        self._calls_pool = ThreadPoolExecutor(4, thread_name_prefix="core-calls")
        self._closed = False
        self.restarts = 0
        self.metrics: list[Any] = []  # the core's latest metrics snapshot (for the hub)
        self.state = "starting"
        self.reason = ""
        self._ready = threading.Event()
        self._proc: _Process
        ready = self._start()
        self.front = Front(config, msg.unpickled(ready.limits))
        self.encoder = Encoder(self.front)
        self._watch = threading.Thread(target=self._watchdog, name="core-watchdog", daemon=True)
        self._watch.start()

    # -- AsyncLLM's surface ----------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.front.tokenizer

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def wait_ready(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for a restarting core; `EngineRestarting` when it is not back
        by then, `EngineDeadError` when it could not come back."""
        if self.state != "ready":
            await asyncio.get_running_loop().run_in_executor(None, self._ready.wait, timeout_s)
        self._check_open()

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        tenant: str = "default",
        lora: LoRARequest | None = None,
    ) -> RequestStream:
        """Sends a request to the core (with the current trace context; on adapter `lora`);
        must be called from a running event loop."""
        ids = self.front.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        with self._lock:
            self._check_open()
            self._counter += 1
            request_id = request_id or f"core-{self._counter}"
            stream = RequestStream(self, request_id, asyncio.get_running_loop())  # type: ignore[arg-type]
            if request_id in self._streams:
                stream.put(ValueError(f"request_id: {request_id!r} is already running"))
                return stream
            self._streams[request_id] = _Live(stream, msg.Totals(request_id, ids))
            carrier = telemetry.get().inject()
            add = msg.Add(request_id, msg.ids_bytes(ids), msg.pickled(params), tenant, carrier)
            if lora is not None:
                add.lora_name, add.lora_path = lora.name, lora.path
            try:
                self._proc.send(add)
            except OSError:  # the core died just now: the watchdog restarts it
                del self._streams[request_id]
                stream.put(EngineRestarting("the engine core is restarting after a failure"))
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> Any:
        async for out in self.add_request(prompt, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._streams and self.state == "ready":
                self._send(msg.Abort(request_id))

    def check_alive(self) -> None:
        """Raises `EngineDeadError` when the core could not come back, or prompts cannot be
        encoded; a core restarting is alive (`state` says so)."""
        if self.state == "failed":
            raise EngineDeadError(f"the engine core is down: {self.reason}")
        if stalled := self.encoder.stalled():
            raise EngineDeadError(f"prompts cannot be encoded: {stalled}")

    def inject(self, kind: str, seconds: float = 0.0) -> None:
        """Tests' fault hook: `hang` stops the core's loop for `seconds`, `exit` ends it."""
        self._send(msg.Inject(kind, seconds))

    def shutdown(self) -> None:
        self._closed = True
        self._ready.set()
        with contextlib.suppress(OSError):
            self._send(msg.Stop())
        try:
            self._proc.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("engine core %d did not stop; killed", self._proc.pid)
        self._proc.kill()
        self.encoder.shutdown()
        self._calls_pool.shutdown(wait=False, cancel_futures=True)

    # -- the core's life -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine has shut down")
        if self.state == "failed":
            raise EngineDeadError(f"the engine core is down: {self.reason}")
        if self.state != "ready":
            raise EngineRestarting("the engine core is restarting after a failure")

    def _send(self, message: Any) -> None:
        try:
            self._proc.send(message)
        except OSError:  # the core is gone: the watchdog fails its streams and restarts it
            log.debug("engine core: a send failed", exc_info=True)

    def _start(self) -> msg.Ready:
        proc = _Process(self.config, self.grammar, self.telemetry_settings)
        ready = proc.ready(self.start_timeout_s)
        self._heard = time.monotonic()
        threading.Thread(target=self._read, args=(proc,), name="core-reader", daemon=True).start()
        with self._lock:  # the new process first: a request let in now is sent to it
            self._proc = proc
            self.state = "ready"
        self._ready.set()
        log.info("engine core %d ready", proc.pid)
        return ready

    def _read(self, proc: _Process) -> None:
        """Every message of one core process, until it ends."""
        try:
            while True:
                message = msg.decode_from_core(proc.conn.recv_bytes())
                self._heard = time.monotonic()
                if isinstance(message, msg.Outputs):
                    self._deliver(message.items)
                elif isinstance(message, msg.Beat):
                    self._beat(message)
                elif isinstance(message, msg.Call):
                    self._calls_pool.submit(self._answer, proc, message)
                elif isinstance(message, msg.Failed):
                    self.reason = message.error
        except (EOFError, OSError):
            return  # the watchdog sees the process end

    def _beat(self, beat: msg.Beat) -> None:
        if beat.metrics:
            self.metrics = msg.unpickled(beat.metrics)

    def _deliver(self, items: list[msg.Output]) -> None:
        for item in items:
            live = self._streams.get(item.request_id)
            if live is None:
                continue
            if item.finished:  # forgotten first: whoever reads the last output sees it gone
                with self._lock:
                    self._streams.pop(item.request_id, None)
            live.stream.put(live.totals.add(item))

    def _answer(self, proc: _Process, call: msg.Call) -> None:
        tel = telemetry.get()
        token = tel.attach(tel.extract(call.trace))  # the core's span: the service's parent
        try:
            value = getattr(self.calls, call.method)(*msg.unpickled(call.args))
            reply = msg.Reply(call.call, value=msg.pickled(value))
        except Exception as exc:
            try:
                reply = msg.Reply(call.call, error=msg.pickled(exc))
            except Exception:  # an exception that does not pickle: its text does
                reply = msg.Reply(call.call, error=msg.pickled(RuntimeError(repr(exc))))
        finally:
            tel.detach(token)
        with contextlib.suppress(OSError):
            proc.send(reply)

    def _watchdog(self) -> None:
        while not self._closed and self.state != "failed":
            time.sleep(WATCH_S)
            proc = self._proc
            if proc.proc.poll() is not None:
                self._lost(f"the engine core exited (status {proc.proc.returncode})")
            elif time.monotonic() - self._heard > self.timeout_s:
                self._lost(f"the engine core was silent for {self.timeout_s:g} s")

    def _lost(self, why: str) -> None:
        """Fails every open stream at once, then starts a new core."""
        if self._closed:
            return
        log.error("%s: failing its requests and restarting it", why)
        with self._lock:
            self.state, self.reason = "restarting", why
            self._ready.clear()
            lost, self._streams = self._streams, {}
        self._proc.kill()
        dead = EngineDeadError(f"{why}; it is restarting")
        for live in lost.values():
            live.stream.put(dead)
        self.restarts += 1
        try:
            self._start()
        except CoreStartError as exc:
            log.error("the engine core could not restart: %s", exc)
            self.state, self.reason = "failed", str(exc)
            self._ready.set()
