"""`LLMReplica`: one engine (continuous batching, masks, KV) per replica, streaming deltas back
through the deployment handle.

Grammars come from `GrammarService` when a handle is given (verdicts over the handle, compiled
grammars loaded here and kept in an LRU), else from an in-process compile service.

Each sequence is a `structserve.generate` span under the caller's trace context (the `trace`
carrier); the engine admits it inside that span, so its grammar resolution joins the trace, and
its queue / prefill / decode spans and TTFT / TPOT are recorded when it finishes
(services/engine/stats.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from opentelemetry import trace as otel_trace
from opentelemetry.trace import Status, StatusCode

from deployments import logprobs
from deployments.adapter_api import AdapterRef, store_of
from deployments.grammar_service import RemoteVerdicts
from deployments.service_config import ServiceConfig
from deployments.telemetry_hub import Pusher, settings_from, setup
from deployments.wire import Delta, Split
from services.compiler.local_builds import LocalBuilds
from services.compiler.service_provider import ServiceGrammarProvider
from services.engine import chat
from services.engine.async_llm import AsyncLLM, EngineDeadError
from services.engine.config import EngineConfig
from services.engine.core_client import CoreClient
from services.engine.engine import LLMEngine
from services.engine.gc_freeze import freeze_startup_objects
from services.engine.params import RequestOutput, SamplingParams
from services.engine.stats import EngineStats
from services.grammar.backends import Backends
from services.grammar.provider import GrammarProvider, ProviderFactory
from services.lora.adapter import BaseShape
from services.lora.manager import LoRARequest
from services.lora.store import StoreUnavailable
from services.models.loader import resolve_model_dir
from services.telemetry import spans

log = logging.getLogger(__name__)


def service_provider(cfg: ServiceConfig, grammar_handle: Any) -> ProviderFactory:
    """The replica's grammars: xgrammar's verdicts from the GrammarService (shared by every
    replica, through Redis), llguidance's built here (they do not serialize)."""

    def make(backends: Backends) -> GrammarProvider:
        xgrammar = backends.xgrammar
        remote = RemoteVerdicts(grammar_handle, xgrammar.tokenizer_info)
        share = cfg.grammar.share_inline_cache
        local = LocalBuilds(
            backends, cfg.grammar.limits, cfg.grammar.mask_budget_ms, share_inline=share
        )
        return ServiceGrammarProvider(xgrammar, remote, local=local, share_inline=share)

    return make


def lora_limits(cfg: ServiceConfig, engine: EngineConfig) -> dict[str, Any]:
    """The base model's projections and the engine's LoRA limits, for registrations' checks."""
    from transformers import AutoConfig

    _, folder = resolve_model_dir(cfg.model)
    config = AutoConfig.from_pretrained(folder)
    base = BaseShape.of(config.get_text_config())
    dims = {k: list(v) for k, v in base.dims.items()}
    layers, rank, size = base.layers, engine.max_lora_rank, engine.max_lora_bytes
    return {"layers": layers, "dims": dims, "max_rank": rank, "max_bytes": size}


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: this process's CPU set (a container's too)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def engine_client(cfg: ServiceConfig, engine: EngineConfig, grammar_handle: Any) -> Any:
    """The engine in a core process of its own (`llm.engine_process`), or on a thread here."""
    if not cfg.llm.engine_process:
        provider = None
        if grammar_handle is not None:
            provider = service_provider(cfg, grammar_handle)
        return AsyncLLM(LLMEngine(engine, grammar_provider=provider))
    grammar = calls = None
    if grammar_handle is not None:  # the core asks this process, which holds the handle
        g = cfg.grammar
        share, budget = g.share_inline_cache, g.mask_budget_ms
        grammar = {"share_inline": share, "limits": g.limits, "mask_budget_ms": budget}
        calls = RemoteVerdicts(grammar_handle)
    tel = settings_from(cfg.telemetry) if cfg.telemetry.enabled else None
    timeout = cfg.llm.engine_core_timeout_s
    return CoreClient(engine, grammar, calls, timeout_s=timeout, telemetry_settings=tel)


class LLMReplica:
    def __init__(
        self, config: dict[str, Any], grammar_handle: Any | None = None, hub: Any | None = None
    ) -> None:
        cfg = ServiceConfig.model_validate(config)
        self.tel = setup(cfg, "LLMReplica", hub)
        weights = cfg.llm.engine.tenant_weights or {t.name: t.weight for t in cfg.tenants}
        # the mask budget is the grammar config's: the probe admits by it, decoding holds to it
        budget = cfg.grammar.mask_budget_ms
        # Ray sets OMP_NUM_THREADS=1 in an actor that reserves no CPUs, and torch would take it
        # as its thread count: the engine takes the CPUs this process may use, unless set
        threads = cfg.llm.engine.num_threads or usable_cpus()
        engine = replace(
            cfg.llm.engine,
            model=cfg.model,
            tenant_weights=weights,
            mask_budget_ms=budget,
            num_threads=threads,
        )
        self.llm = engine_client(cfg, engine, grammar_handle)
        # an engine core in its own process reports its numbers itself, pushed from here
        self.stats = EngineStats(getattr(self.llm, "engine", None), self.tel)
        self.core_pusher = None
        if isinstance(self.llm, CoreClient) and hub is not None and self.tel.enabled:
            client = self.llm
            self.core_pusher = Pusher(hub, "EngineCore", snapshot=lambda: client.metrics)
        self.front = front = self.llm.front  # tokenizer, template, limits
        self.token_text = logprobs.TokenText(front.tokenizer)
        self.model_name = cfg.served_model_name
        llm = cfg.llm
        self.dialect = chat.resolve(front.tokenizer, llm.tool_call_format, llm.reasoning_format)
        self.lora = lora_limits(cfg, engine) if engine.enable_lora else None
        self.adapter_store = store_of(cfg)
        self.restart_wait_s = cfg.llm.restart_wait_s
        freeze_startup_objects(engine.freeze_gc)  # the engine's own process does the same

    async def generate(
        self,
        prompt: str | list[int] | None,
        messages: list[dict[str, Any]] | None,
        params: SamplingParams,
        tenant: str,
        request_id: str,
        trace: dict[str, str] | None = None,
        template: dict[str, Any] | None = None,
        answer: dict[str, Any] | None = None,
        adapter: AdapterRef | None = None,
    ) -> AsyncIterator[Delta]:
        """`template`: chat template options (`add_generation_prompt`, `tools`, ...); `answer`
        (a chat request's): its `tool_choice` and `parallel`; `adapter`: a LoRA adapter's
        (deployments/adapter_api.py), whose files a bucket store copies here first. A chat answer
        is shaped in the model's dialect (services/engine/chat.py); when it may hold thinking or
        calls, the first delta carries how to split it (`answer`: the tag and the tool names) for
        the ingress."""
        try:  # off the event loop and the engine thread, after the character cap
            prompt_ids = await self.llm.encoder.encode(prompt, messages, template, tenant)
            turn = None
            if answer is not None:
                tools = (template or {}).get("tools")
                choice, parallel = answer["tool_choice"], answer["parallel"]
                turn = chat.shape(
                    self.front, self.dialect, prompt_ids, params, tools, choice, parallel
                )
                params = turn.params
            lora = None
            if adapter is not None:
                folder = await asyncio.to_thread(adapter.folder, self.adapter_store)
                lora = LoRARequest(adapter.name, str(folder))
            await self.llm.wait_ready(self.restart_wait_s)  # a core restarting: within reason
        except (ValueError, EngineDeadError, StoreUnavailable) as exc:  # 503s too
            yield Delta.refusal(str(exc)[:300], getattr(exc, "status", 400))
            return
        split = None
        if turn is not None and turn.split:
            split = Split(turn.tag, list(turn.parameters), turn.schema)
        tel = self.tel
        attrs: dict[str, Any] = {
            spans.REQUEST_ID: request_id,
            spans.TENANT: tenant,
            spans.REQUEST_MAX_TOKENS: params.max_tokens,
        }
        if params.structured is not None:
            attrs[spans.GRAMMAR_KIND] = params.structured.kind
        span = tel.tracer.start_span(spans.GENERATE, tel.extract(trace), attributes=attrs)
        ctx = otel_trace.set_span_in_context(span)
        token = tel.attach(ctx)  # the engine admits the request (and starts its grammar) in it
        try:
            stream = self.llm.add_request(prompt_ids, params, request_id, tenant, lora)
        finally:
            tel.detach(token)
        last: RequestOutput | None = None
        sent = Delta()
        try:
            async for out in stream:
                last = out
                sent = Delta.of(out, self.token_text)
                if split is not None:
                    sent, split = replace(sent, answer=split), None
                yield sent
        except EngineDeadError as exc:  # the core died under it: a last delta saying so
            yield sent.ended(str(exc)[:300], 503)
        except asyncio.CancelledError:  # the client went away: free the slot and the pages
            self.llm.abort(request_id)
            raise
        finally:
            self._finished(span, ctx, params, last)

    def _finished(
        self, span: Any, ctx: Any, params: SamplingParams, out: RequestOutput | None
    ) -> None:
        try:
            self._record(span, ctx, params, out)
        except Exception:  # telemetry never fails a request
            log.debug("telemetry: recording a sequence failed", exc_info=True)

    def _record(
        self, span: Any, ctx: Any, params: SamplingParams, out: RequestOutput | None
    ) -> None:
        if out is not None and out.finished:
            self.stats.finished(out.metrics, params.structured is not None, ctx)
        if not span.is_recording():
            return
        if out is not None:
            span.set_attribute(spans.USAGE_INPUT_TOKENS, len(out.prompt_token_ids))
            span.set_attribute(spans.USAGE_OUTPUT_TOKENS, len(out.token_ids))
            if out.finish_reason is not None:
                span.set_attribute(spans.RESPONSE_FINISH_REASONS, [out.finish_reason])
            if out.finish_reason == "error":
                span.set_status(Status(StatusCode.ERROR, (out.warnings or ["error"])[-1][:200]))
        if out is None or not out.finished:
            span.set_attribute(spans.RESPONSE_FINISH_REASONS, ["abort"])
        span.end()

    async def tokenize(
        self,
        prompt: str | None,
        messages: list[dict[str, Any]] | None,
        template: dict[str, Any] | None,
        tenant: str = "default",
    ) -> dict[str, Any]:
        try:
            ids = await self.llm.encoder.encode(prompt, messages, template, tenant, route=True)
        except ValueError as exc:
            return {"error": str(exc)[:300], "status": getattr(exc, "status", 400)}
        limit = self.front.max_model_len
        return {"count": len(ids), "max_model_len": limit, "tokens": ids}

    async def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        vocab = self.front.limits.vocab_size
        if bad := [t for t in tokens if not 0 <= t < vocab]:
            message = f"tokens: {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            return {"error": message, "status": 400}
        text = await asyncio.to_thread(self.front.tokenizer.decode, tokens)
        return {"prompt": text}

    async def limits(self) -> dict[str, int]:
        """What the ingress checks before a prompt crosses to a replica (deployments/gate.py)."""
        return {
            "max_prompt_chars": self.front.limits.max_prompt_chars,
            "max_model_len": self.front.max_model_len,
            "lora": self.lora,  # the base model's shape an adapter must fit; None: LoRA off
        }

    async def check_health(self) -> dict[str, str]:
        """Raises when the engine cannot serve (Ray restarts the replica); a core restarting
        after a crash is not that: `engine` says "restarting" for /healthz."""
        self.llm.check_alive()
        return {"engine": getattr(self.llm, "state", "ready")}

    def __del__(self) -> None:
        stats = getattr(self, "stats", None)
        if stats is not None:
            stats.close()
        if (pusher := getattr(self, "core_pusher", None)) is not None:
            pusher.stop()
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()
