"""`LLMReplica`: one engine (continuous batching, masks, KV) per replica, streaming deltas back
through the deployment handle.

Grammars come from `GrammarService` when a handle is given (verdicts over the handle, compiled
grammars loaded here and kept in an LRU), else from an in-process compile service.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from deployments.config import ServiceConfig
from services.engine.async_llm import AsyncLLM
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.params import RequestOutput, SamplingParams


def delta_dict(out: RequestOutput) -> dict[str, Any]:
    """What crosses the handle for one streamed step (small: no prompt ids, no whole text)."""
    return {
        "delta_text": out.delta_text,
        "num_delta_tokens": len(out.delta_token_ids),
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "warnings": out.warnings if out.finished else [],
        "validated": out.validated,
        "error_status": out.error_status,
    }


class LLMReplica:
    def __init__(self, config: dict[str, Any], grammar_handle: Any | None = None) -> None:
        cfg = ServiceConfig.model_validate(config)
        self.engine = LLMEngine(EngineConfig(model=cfg.model, **cfg.llm.engine))
        if grammar_handle is not None:
            from deployments.grammar_service import RemoteVerdicts
            from services.compiler import ServiceGrammarProvider

            backend = self.engine.grammars.backend
            remote = RemoteVerdicts(grammar_handle, backend.tokenizer_info)  # type: ignore[attr-defined]
            self.engine.grammars.use_provider(ServiceGrammarProvider(backend, remote))  # type: ignore[arg-type]
        self.llm = AsyncLLM(self.engine)
        self.model_name = cfg.served_model_name

    async def generate(
        self,
        prompt: str | list[int] | None,
        messages: list[dict[str, Any]] | None,
        params: SamplingParams,
        tenant: str,
        request_id: str,
    ) -> AsyncIterator[dict[str, Any]]:
        if messages is not None:
            prompt_ids: str | list[int] = self.engine.apply_chat_template(messages)
        else:
            assert prompt is not None  # the ingress sends one of the two
            prompt_ids = prompt
        stream = self.llm.add_request(prompt_ids, params, request_id, tenant)
        try:
            async for out in stream:
                yield delta_dict(out)
        except asyncio.CancelledError:  # the client went away: free the slot and the pages
            self.llm.abort(request_id)
            raise

    async def check_health(self) -> None:
        self.llm.check_alive()

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()
