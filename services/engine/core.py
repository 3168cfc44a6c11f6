"""The engine core: a process of its own per LLM replica, owning the model, the scheduler, the KV
pool, the grammar matchers and the step loop (`llm.engine_process`; core_client.py starts it).

Why a process: the replica's event loop, its handle traffic (cancels included), templating and
tokenization shared one interpreter lock with the step loop, so one tenant's request churn
slowed every other tenant's forward. Here the loop only ever waits for the device and its own
mask workers.

It speaks core_messages.py over one pipe: a reader thread takes adds and aborts into a queue
the loop drains between steps (as `AsyncLLM`'s engine thread does) and answers the grammar
calls this process made; the loop sends one `Outputs` per step and a `Beat` at least every
`BEAT_S`, so a replica that hears nothing for its timeout knows the loop is stuck. Grammar
verdicts come from the replica (`PipeVerdicts`): only it can reach the grammar service.

Telemetry: with the replica's settings, this process exports its own spans (a request is
admitted inside the replica's span, so its grammar's spans join the trace) and its beats carry
its metrics once a second, which the replica pushes to the hub as the `EngineCore` component.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from services import telemetry
from services.engine import core_messages as msg
from services.engine.config import EngineConfig
from services.engine.gc_freeze import freeze_startup_objects
from services.engine.stats import EngineStats
from services.lora.manager import LoRARequest

log = logging.getLogger(__name__)

BEAT_S = 0.5
METRICS_S = 1.0  # how often a beat carries the core's metrics
CALL_TIMEOUT_S = 180.0  # as the replica's own wait on the grammar service


class Wire:
    """The pipe's sending side, shared by the loop and the grammar resolver threads."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: Any) -> None:
        raw = msg.encode(message)
        with self.lock:
            self.conn.send_bytes(raw)


class PipeVerdicts:
    """A `VerdictSource` (services/compiler/resolving.py) whose verdicts the replica fetches:
    keys are computed here, calls wait on the replica's reply (from resolver threads only)."""

    def __init__(self, wire: Wire, tokenizer_info: Any) -> None:
        from services.compiler.service import GrammarKeys

        self.wire = wire
        self.keys = GrammarKeys(tokenizer_info)
        self.pending: dict[int, Future[Any]] = {}
        self.ids = itertools.count()

    def key(self, spec: Any, scope: str = "shared") -> str:
        return self.keys.key(spec, scope)

    def verdict(
        self, spec: Any, tenant: str = "default", scope: str = "shared", fresh: bool = False
    ) -> Any:
        return self._call("verdict", spec, tenant, scope, fresh)

    def downgrade(
        self, spec: Any, tenant: str, scope: str, reason: str, error: str, path: str = ""
    ) -> None:
        self._call("downgrade", spec, tenant, scope, reason, error, path)

    def resolve(self, tenant: str, grammar_id: str) -> Any:
        return self._call("resolve", tenant, grammar_id)

    def answered(self, reply: msg.Reply) -> None:
        future = self.pending.pop(reply.call, None)
        if future is None:
            return
        if reply.error:
            future.set_exception(msg.unpickled(reply.error))
        else:
            future.set_result(msg.unpickled(reply.value))

    def close(self) -> None:
        for future in list(self.pending.values()):
            future.set_exception(RuntimeError("the engine core is stopping"))
        self.pending.clear()

    def _call(self, method: str, *args: Any) -> Any:
        call = next(self.ids)
        future: Future[Any] = Future()
        self.pending[call] = future
        carrier = telemetry.get().inject()  # the resolve span this runs in
        self.wire.send(msg.Call(call, method, msg.pickled(args), carrier))
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        finally:
            self.pending.pop(call, None)


def grammar_factory(core: EngineCore, grammar: dict[str, Any]) -> Any:
    """The replica's grammar provider, rebuilt here: xgrammar's verdicts through the replica,
    llguidance's built in this process (services/compiler/service_provider.py)."""
    from services.compiler.local_builds import LocalBuilds
    from services.compiler.service_provider import ServiceGrammarProvider

    def make(backends: Any) -> Any:
        xgrammar = backends.xgrammar
        remote = core.remote = PipeVerdicts(core.wire, xgrammar.tokenizer_info)
        share = grammar["share_inline"]
        local = LocalBuilds(
            backends, grammar["limits"], grammar["mask_budget_ms"], share_inline=share
        )
        return ServiceGrammarProvider(xgrammar, remote, local=local, share_inline=share)

    return make


class EngineCore:
    def __init__(self, conn: Any, config: EngineConfig, grammar: dict[str, Any] | None) -> None:
        from services.engine.engine import LLMEngine

        self.wire = Wire(conn)
        self.conn = conn
        self.remote: PipeVerdicts | None = None  # set once the provider is built
        provider = grammar_factory(self, grammar) if grammar is not None else None
        self.engine = LLMEngine(config, grammar_provider=provider)
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.live: dict[str, int] = {}  # request -> logprobs already sent
        self.steps = 0
        self.last_beat = self.last_metrics = 0.0
        self.tel = telemetry.get()
        self.stats = EngineStats(self.engine, self.tel)  # its gauges, mask and tier timings

    def run(self) -> None:
        freeze_startup_objects(self.engine.config.freeze_gc)
        self.wire.send(msg.Ready(msg.pickled(self.engine.limits)))
        threading.Thread(target=self._read, name="core-reader", daemon=True).start()
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                self._step()
        except BaseException as exc:  # the replica fails every stream and restarts this core
            log.exception("engine core loop stopped")
            self._send_quietly(msg.Failed(f"engine loop failed: {exc!r}"[:500]))
        finally:
            self.engine.grammars.shutdown()
            self.engine.chat.close()

    def _read(self) -> None:
        """Every message from the replica; grammar replies are answered here (the loop may be
        waiting for none of them), the rest queued for the loop."""
        try:
            while True:
                message = msg.decode_to_core(self.conn.recv_bytes())
                if isinstance(message, msg.Reply):
                    if self.remote is not None:
                        self.remote.answered(message)
                else:
                    self.commands.put(message)
        except (EOFError, OSError):  # the replica is gone: so is this process's purpose
            self.commands.put(msg.Stop())

    def _drain(self, block: bool) -> bool:
        """Applies queued commands; waits up to a beat when idle. False once asked to stop."""
        try:
            message = self.commands.get(timeout=BEAT_S) if block else self.commands.get_nowait()
            while True:
                if isinstance(message, msg.Stop):
                    return False
                self._apply(message)
                message = self.commands.get_nowait()
        except queue.Empty:
            self._beat()
            return True

    def _apply(self, message: Any) -> None:
        if isinstance(message, msg.Add):
            params = msg.unpickled(message.params)
            prompt = msg.ids_list(message.prompt)
            rid = message.request_id
            token = self.tel.attach(self.tel.extract(message.trace))  # its grammar's spans too
            lora = LoRARequest(message.lora_name, message.lora_path) if message.lora_name else None
            try:
                req = self.engine.add_request(prompt, params, rid, message.tenant, lora)
            except Exception as exc:  # the client never sends a live id twice: logged only
                log.warning("request %s refused: %r", rid, exc)
                return
            finally:
                self.tel.detach(token)
            self.live[rid] = 0
            if req.finished:
                self._send([rid])
        elif isinstance(message, msg.Abort):
            if message.request_id in self.live:
                self.engine.abort(message.request_id)
                self._send([message.request_id])
        elif isinstance(message, msg.Inject):
            if message.kind == "hang":
                time.sleep(message.seconds)
            elif message.kind == "exit":
                os._exit(3)

    def _step(self) -> None:
        try:
            updated = self.engine.step()
        except Exception as exc:
            from services.engine.failures import is_engine_fault

            self._send(list(self.live))  # `step` failed every request: each gets its error
            if is_engine_fault(exc):
                raise
            log.exception("engine step failed; its requests were failed, the loop goes on")
            return
        self.steps += 1
        self._send([r.request_id for r in updated])

    def _send(self, request_ids: list[str]) -> None:
        items = []
        for rid in request_ids:
            req = self.engine.requests.get(rid)
            if req is None or rid not in self.live or req.held:
                continue
            out = self.engine.contained_output(req)
            items.append(msg.output_of(out, self.live[rid]))
            self.live[rid] = len(out.logprobs or ())
            if out.finished:
                del self.live[rid]
                self.engine.release(rid)
        if items:
            self.wire.send(msg.Outputs(items))
        self._beat()

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat < BEAT_S:
            return
        self.last_beat = now
        metrics = b""
        if self.tel.enabled and now - self.last_metrics >= METRICS_S:
            self.last_metrics = now
            metrics = msg.pickled(self.tel.snapshot())
        self.wire.send(msg.Beat(self.steps, metrics))

    def _send_quietly(self, message: Any) -> None:
        with contextlib.suppress(OSError):
            self.wire.send(message)


def main(argv: list[str]) -> None:
    """The entry point core_client.py runs: `python -m services.engine.core FD PARENT_PID`;
    the first message on the socket is `(EngineConfig, grammar settings or None, telemetry
    settings or None)`."""
    from multiprocessing.connection import Connection

    from services.sandbox.worker import die_with_parent

    fd, parent = int(argv[0]), int(argv[1])
    die_with_parent(parent)
    conn = Connection(fd)
    try:
        config, grammar, settings = conn.recv()
    except EOFError:
        return
    logging.basicConfig(level=logging.INFO, format="engine-core %(levelname)s %(message)s")
    if settings is not None:  # the replica's telemetry settings: spans exported from here
        telemetry.configure(settings, "EngineCore")
    serve(conn, config, grammar)


def serve(conn: Any, config: EngineConfig, grammar: dict[str, Any] | None) -> None:
    try:
        core = EngineCore(conn, config, grammar)
    except BaseException as exc:  # the replica reports it, and does not restart in a loop
        log.exception("engine core failed to start")
        Wire(conn).send(msg.Failed(f"the engine core failed to start: {exc!r}"[:500]))
        return
    core.run()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
