"""The engine: requests in, one step at a time, outputs out.

`step()` is the whole loop body: schedule, run the model, sample, update. Everything else here is
request bookkeeping: admission checks, stop conditions, outputs and freeing pages.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvcache.policies import new_state
from services.engine.config import EngineConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.grammar.manager import GrammarManager
from services.engine.grammar.provider import GrammarProvider
from services.engine.kv_offload import OffloadManager
from services.engine.model_runner import ModelRunner
from services.engine.params import FinishReason, KVPolicy, RequestOutput, SamplingParams
from services.engine.request import Request
from services.engine.sampler import Sampler
from services.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.kv_tier import HostPageStore
from services.models import LoadedModel

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
# Streams under a re-rotating policy have no context limit of their own: this caps them
STREAM_LIMIT = 1 << 24


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        grammar_provider: GrammarProvider | None = None,
    ):
        self.config = config = config or EngineConfig()
        self.runner = ModelRunner(config, loaded)
        self.tokenizer = self.runner.loaded.tokenizer
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                page_size=config.page_size,
            ),
            self.runner.kv.allocator,
        )
        self.sampler = Sampler(self.runner.device, config.seed)
        self.pool_tokens = pool_tokens = self.runner.kv.num_pages * config.page_size
        model_len = int(getattr(self.runner.model.config, "max_position_embeddings", pool_tokens))
        self.model_len = model_len
        self.max_model_len = min(config.max_model_len or model_len, model_len, pool_tokens)
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarManager(
            self.tokenizer,
            self.runner.vocab_size,
            sorted(self.eos_token_ids),
            max_rows=config.max_num_seqs,
            overlap=config.overlap_masks,
            provider=grammar_provider,
            workers=config.grammar_workers,
            redis_url=config.grammar_redis_url,
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.kv_tier: HostPageStore | None = None
        self.offload: OffloadManager | None = None
        if config.kv_tier_pages:
            kv = self.runner.kv
            self.kv_tier = HostPageStore(
                kv.layout,
                config.kv_tier_pages,
                kv.device,
                default_tenant_cap=config.kv_tier_tenant_pages,
            )
            self.offload = OffloadManager(kv, self.kv_tier, self.scheduler)
            self.scheduler.on_release = self.offload.release
            self.scheduler.reclaim = self.offload.reclaim

    def _eos_token_ids(self) -> frozenset[int]:
        model = self.runner.model
        return eos_token_ids(model.generation_config, model.config, self.tokenizer)

    # -- requests in -------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        tenant: str = "default",
    ) -> Request:
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        prompt_ids = self.tokenize(prompt)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop or ()),  # type: ignore[arg-type]
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            generator=generator,
            tenant=tenant,
        )
        req.kv_state = new_state(params.kv, self.config.page_size)
        self.requests[request_id] = req
        refusal = self._refusal(req)
        if refusal:
            req.warnings.append(refusal)
            req.error_status = 400
            self._finish(req, "error")
            return req
        if req.kv_state is not None and req.kv_state.policy.offload:
            assert self.offload is not None  # `_refusal` checked
            refusal = self.offload.admit(req)
            if refusal:
                req.warnings.append(refusal)
                req.error_status = 429
                self._finish(req, "error")
                return req
        if params.structured is not None:
            self.grammars.attach(req)
        self.scheduler.add(req)
        return req

    def _refusal(self, req: Request) -> str | None:
        params, n = req.params, req.num_prompt_tokens
        if n == 0:
            return "prompt: is empty"
        vocab = self.runner.vocab_size
        if bad := [t for t in req.prompt_token_ids if not 0 <= t < vocab]:
            return f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
        limit = self.max_model_len
        if req.kv_state is not None:
            refusal = self._kv_refusal(req.kv_state.policy)
            if refusal:
                return refusal
            limit = req.context_limit = self._context_limit(req.kv_state.policy)
        if n + params.max_tokens > limit:
            return (
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum context of {limit} tokens"
            )
        snapkv = req.kv_state is not None and req.kv_state.policy.kind == "snapkv"
        if snapkv and n > self.pool_tokens:  # the whole prompt is cached until it has voted
            return f"prompt: {n} tokens do not fit the KV pool ({self.pool_tokens} tokens)"
        return None

    def _kv_refusal(self, kv: KVPolicy) -> str | None:
        ps = self.config.page_size
        if kv.page_size is not None and kv.page_size != ps:
            return f"kv.page_size: must equal the engine's page size ({ps}), got {kv.page_size}"
        if kv.offload and self.offload is None:
            return "kv.offload: this engine has no host page tier (set kv_tier_pages)"
        if kv.rerotate and self.runner.rotate is None:
            return "kv.rerotate: this model has no rotary embedding to re-rotate keys with"
        if kv.bounded and kv.budget + ps > min(self.pool_tokens, self.model_len):
            return (
                f"kv.budget_tokens: {kv.budget} (+ one page) exceeds the KV pool or the model's "
                f"context ({min(self.pool_tokens, self.model_len)} tokens)"
            )
        return None

    def _context_limit(self, kv: KVPolicy) -> int:
        """Bounded policies hold budget + one page, whatever the length; positions still grow,
        except under `rerotate`, where they stay inside the cache (StreamingLLM)."""
        if kv.offload:  # parked pages live on the host: the pool no longer caps the context
            assert self.kv_tier is not None
            tier_tokens = (
                self.runner.kv.num_pages + self.kv_tier.capacity_pages
            ) * self.config.page_size
            return min(self.config.max_model_len or self.model_len, self.model_len, tier_tokens)
        if not kv.bounded:
            return self.max_model_len
        if kv.rerotate:
            return self.config.max_model_len or STREAM_LIMIT
        return min(self.config.max_model_len or self.model_len, self.model_len)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One forward pass; returns the requests that produced tokens or finished."""
        failed = self._resolve_grammars()
        sched = self.scheduler.schedule()
        if not sched.chunks:
            self.grammars.wait_for_compiles(timeout=0.01)
            return failed
        self._mark_scheduled(sched)
        sampling = [c.request for c in sched.chunks if c.samples]
        masks = self.grammars.start_masks(sampling)  # filled on a worker while the forward runs
        logits = self.runner.forward(sched.chunks)
        self.grammars.apply_masks(masks, logits)
        tokens = self.sampler(logits, sampling)
        updated = self._update(sched, sampling, tokens)
        self._apply_kv_policies(sched)
        return failed + updated

    def _resolve_grammars(self) -> list[Request]:
        failed = self.grammars.resolve()
        for req in failed:
            self._finish(req, "error")
        return failed

    def _mark_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.perf_counter()
        for c in sched.chunks:
            if c.request.metrics.first_scheduled_time is None:
                c.request.metrics.first_scheduled_time = now

    def _update(
        self, sched: SchedulerOutput, sampling: list[Request], tokens: list[int]
    ) -> list[Request]:
        for c in sched.chunks:
            c.request.num_computed_tokens += c.num_tokens
        now = time.perf_counter()
        for req, token in zip(sampling, tokens, strict=True):
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            reason = self.grammars.accept(req, token)
            new = [token]
            if reason is None and self.config.jump_forward:
                room = min(
                    req.params.max_tokens - req.num_output_tokens,
                    (req.context_limit or self.max_model_len) - req.num_tokens,
                )
                new = self.grammars.jump_forward(req, token, room)
            req.token_ids.extend(new)
            req.detokenizer.add_tokens(new)
            reason = reason or self._stop_reason(req, new[-1])
            if reason:
                self._finish(req, reason)
        return sampling

    def _apply_kv_policies(self, sched: SchedulerOutput) -> None:
        """Bounded policies evict after each step that filled their slack; pages go back.
        Offloaded requests grow their hot set and park their cold pages."""
        ps = self.config.page_size
        for c in sched.chunks:
            req, state = c.request, c.request.kv_state
            if state is None or req.finished:
                continue
            if state.impl.should_compact(state, req.num_computed_tokens, req.num_prompt_tokens, ps):
                self.scheduler.release_pages(req, self.runner.compact(req))
            if state.tier is not None and self.offload is not None:
                self.offload.after_step(req)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        if token in req.eos_token_ids or token in (req.params.stop_token_ids or ()):
            return "stop"
        if req.detokenizer.stopped:
            return "stop"
        limit = req.context_limit or self.max_model_len
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= limit:
            return "length"
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.metrics.finished_time = time.perf_counter()
        req.metrics.num_output_tokens = req.num_output_tokens
        self.scheduler.finish(req)
        self.grammars.validate(req)

    # -- outputs out ---------------------------------------------------------------------------

    def make_output(self, req: Request) -> RequestOutput:
        """A delta since the last call for this request, with the text and tokens so far."""
        delta_ids = req.take_new_token_ids()
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            text=req.detokenizer.text,
            token_ids=req.output_token_ids,
            finished=req.finished,
            finish_reason=req.finish_reason,
            delta_text=req.detokenizer.take_delta(final=req.finished),
            delta_token_ids=delta_ids,
            metrics=req.metrics,
            warnings=list(req.warnings),
            validated=req.validated,
            error_status=req.error_status,
            prompt_logprobs=req.prompt_logprobs if req.finished else None,
        )

    def release(self, request_id: str) -> None:
        """Forgets a finished request once its last output was taken."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            del self.requests[request_id]


def eos_token_ids(*sources: Any) -> frozenset[int]:
    """Every end-of-sequence id named by the generation config, the model config or the tokenizer
    (the grammar service computes the same set, so both build the same tokenizer info)."""
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)
