"""The engine: requests in, one step at a time, outputs out.

`step()` is the whole loop body: schedule, run the model, sample, update (each sampled token
takes `token_path.py`, drafted or not). Everything else here is request bookkeeping: admission
checks, endings, outputs and freeing pages.

Whatever belongs to one request runs inside the failure boundary (`failures.py`): it fails that
request alone (`finish_reason="error"`, the cause in `warnings`, its pages freed) and the batch
goes on. A fault of the whole engine fails every request before it propagates (`fail_all`).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from kvcache import hot_set
from kvcache.host_tier import HostPageStore
from kvcache.policies import new_state
from services import settings
from services.compiler.build import provider_for
from services.engine import admission, failures
from services.engine import logits as logits_processors
from services.engine.admission import Prompt
from services.engine.chat_template import ChatRenderer
from services.engine.config import EngineConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.failures import Boundary, RequestError
from services.engine.kv_offload import OffloadManager
from services.engine.model_runner import ModelRunner
from services.engine.params import FinishReason, RequestOutput, SamplingParams
from services.engine.prefix_cache import PrefixCache
from services.engine.request import Request, RequestStatus
from services.engine.sampler import Sampled, Sampler
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.speculative import DraftStep, SampleRows, Speculator
from services.engine.structured.checked import Rollback
from services.engine.structured.manager import Failure, GrammarManager, nothing_left
from services.engine.structured.masks import PendingMasks
from services.engine.token_path import TokenPath
from services.grammar.backends import for_model
from services.grammar.provider import GrammarProvider, ProviderFactory
from services.lora.manager import AdapterManager, LoRARequest
from services.models import LoadedModel, eos_token_ids

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        grammar_provider: GrammarProvider | ProviderFactory | None = None,
    ):
        self.config = config = config or EngineConfig()
        self.runner = ModelRunner(config, loaded)
        self.tokenizer = self.runner.loaded.tokenizer
        self.scheduler = Scheduler.for_engine(config, self.runner.kv.allocator, self.runner.device)
        if config.enable_prefix_caching:
            self.scheduler.prefix = PrefixCache.for_runner(self.runner)
        self.scheduler.adapters = self.adapters = AdapterManager.on(self.runner.lora, config)
        self.sampler = Sampler(self.runner.device, config.seed)
        self.pool_tokens = pool_tokens = self.runner.kv.num_pages * config.page_size
        model_len = int(getattr(self.runner.model.config, "max_position_embeddings", pool_tokens))
        self.model_len = model_len
        self.max_model_len = min(config.max_model_len or model_len, model_len, pool_tokens)
        model = self.runner.model
        self.eos_token_ids = eos_token_ids(model.generation_config, model.config, self.tokenizer)
        spec = config.speculation.speculative_config()
        self.speculator = Speculator(spec, self.max_model_len) if spec is not None else None
        backends = for_model(
            self.tokenizer, model.config, model.generation_config, config.grammar_backend
        )
        self.grammars = GrammarManager(
            backends,
            # not handed one: its own, whose probe holds grammars to the budget it decodes under
            grammar_provider
            or provider_for(
                config.grammar_workers, config.grammar_redis_url, config.mask_budget_ms
            ),
            max_rows=config.max_num_seqs,
            overlap=config.overlap_masks,
            mask_budget_ms=config.mask_budget_ms,
            mask_strikes=config.mask_strikes,
            validation_timeout_s=config.validation_timeout_s,
            sandbox_workers=config.sandbox_workers,
            mask_deadline_ms=config.mask_deadline_ms,
            mask_workers=config.mask_workers,
            check_retries=config.check_retries,
        )
        self.tokens = TokenPath(
            self.grammars, config.jump_forward, self.max_model_len, self._finish
        )
        self.chat = ChatRenderer(self.tokenizer, config.sandbox_workers, config.template_timeout_s)
        self.boundary = Boundary(self._fail)
        self.drafts = DraftStep(
            self.boundary, self._mask_row, self.sampler.verify, self.tokens.take
        )
        self.grammars.check = self.check_fault
        self.requests: dict[str, Request] = {}
        self.validating: list[Request] = []  # finished, their output being validated
        self._ids = itertools.count()
        self.kv_tier: HostPageStore | None = None
        self.offload: OffloadManager | None = None
        if config.kv_tier_pages:
            kv = self.runner.kv
            self.kv_tier = HostPageStore(
                kv.layout,
                config.kv_tier_pages,
                kv.device,
                default_tenant_cap=config.tier_tenant_cap(),
            )
            kernels = settings.cache_dir() / "kernels"
            router = hot_set.router(kernels) if config.native_hot_set else None
            self.offload = OffloadManager(kv, self.kv_tier, self.scheduler, router)
            self.scheduler.on_release = self.offload.release
            self.scheduler.reclaim = self.offload.reclaim
        tier_pages = self.kv_tier.capacity_pages if self.kv_tier is not None else None
        self.limits = admission.Limits.of(
            config, self.runner, model_len, self.max_model_len, tier_pages
        )

    # -- requests in -------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, after the character cap (`ValueError` naming the field).
        Thread-safe: servers call it off the engine thread."""
        return admission.tokenize(self.tokenizer, prompt, self.limits.max_prompt_chars)

    def apply_chat_template(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """The model's template, bounded and tokenized (chat_template.py); thread-safe too."""
        return self.chat.ids(messages, self.limits.max_prompt_chars, **options)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        tenant: str = "default",
        lora: LoRARequest | None = None,
    ) -> Request:
        """Queues a request (on adapter `lora`: services/lora). One refused on its own comes
        back finished with an error (the reason in `warnings`); only a duplicate `request_id`
        raises."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        req = Request(
            request_id=request_id,
            prompt_token_ids=[],
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, [], ()),
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            tenant=tenant,
            lora_name=None if lora is None else lora.name,
        )
        self.requests[request_id] = req
        with self.boundary.request(req) as stage:
            stage("admit")
            self._admit(req, prompt, lora)
        return req

    def _admit(self, req: Request, prompt: Prompt, lora: LoRARequest | None = None) -> None:
        params = req.params
        if lora is not None:  # read and checked here: a bad adapter fails its request alone
            live = {r.lora_name for r in self.requests.values() if r.lora_name and r is not req}
            if self.adapters is None:
                raise RequestError("lora_request: start the engine with enable_lora", 400)
            if refusal := self.adapters.refusal(lora, live):
                raise RequestError(refusal, status=400)
            req.lora_scope = self.adapters.scope(lora.name)
        try:
            req.prompt_token_ids = self.tokenize(prompt)
        except ValueError as exc:
            raise RequestError(str(exc), status=400) from exc
        req.token_ids = list(req.prompt_token_ids)
        req.metrics.num_prompt_tokens = req.num_prompt_tokens
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            req.prompt_token_ids,
            params.stop or (),  # type: ignore[arg-type]
            min_tokens=params.min_tokens,
        )
        if params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device)
            req.generator.manual_seed(params.seed)
        req.kv_state = new_state(params.kv, self.config.page_size)
        refusal = admission.refusal(req, self.limits)
        if refusal:
            raise RequestError(refusal, status=400)
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.scope(req)
        if req.kv_state is not None and req.kv_state.policy.offload:
            assert self.offload is not None  # `admission.refusal` checked
            refusal = self.offload.admit(req)
            if refusal:
                raise RequestError(refusal, status=429)
        if params.structured is not None:
            self.grammars.attach(req)
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.validating)

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One forward pass; returns the requests that produced tokens or finished. A fault no
        single request owns fails every request, then propagates."""
        try:
            return self._step()
        except Exception as exc:
            self.fail_all(f"engine: the step failed ({type(exc).__name__}: {exc})"[:300])
            raise

    def _step(self) -> list[Request]:
        failed = self._resolve_grammars()
        resumed = self._resume_parked()  # requests whose late grammar work came in: sampled now
        if self.speculator is not None:  # drafts for the requests about to decode
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.chunks:
            reads = [r for _, r in self.adapters.reading.values()] if self.adapters else []
            self.grammars.wait(0.01, self.validating, reads)
            return failed + resumed + self._validated()
        self._mark_scheduled(sched)
        rows = SampleRows.of(sched.chunks)
        sampling = rows.plain  # drafted requests are verified on their own, after
        masks = self.grammars.start_masks(sampling)  # filled on workers while the forward runs
        every = failures.forward(self.runner, self.boundary, sched.chunks, rows, self.check_fault)
        logits = rows.plain_logits(every)
        logits_processors.apply(logits, sampling)  # penalties, bias, min_tokens: before the mask
        sampling, logits = self._apply_masks(masks, sampling, logits)
        tokens = failures.sample(self.sampler, logits, sampling)
        updated = self._update(sched, sampling, tokens)
        if self.speculator is not None and rows.drafted:
            updated += self.speculator.verify(rows, every, self.drafts)
        self._apply_kv_policies(sched)
        return failed + resumed + [r for r in updated if r.ready or r.finished] + self._validated()

    def _apply_masks(
        self, masks: PendingMasks | None, sampling: list[Request], logits: torch.Tensor
    ) -> tuple[list[Request], torch.Tensor]:
        """Masks the rows whose fill is in; a row whose fill missed the deadline leaves the step
        (parked with its logits: it samples once the fill is in), and the others sample as a
        batch without it."""
        failed, late = self.grammars.apply_masks(masks, logits)
        self.fail_each(failed)
        if not late:
            return sampling, logits
        for i, fill in late.items():
            self.grammars.park(sampling[i], fill, logits[i : i + 1])
        keep = [i for i in range(len(sampling)) if i not in late]
        return [sampling[i] for i in keep], logits[keep]

    def _mask_row(self, req: Request, row: torch.Tensor) -> bool:
        """Masks one row of `req` (a draft's position); False when that failed the request, or
        its fill missed the deadline (parked with `row`: the walk stops there)."""
        kept, _ = self._apply_masks(self.grammars.start_masks([req]), [req], row)
        return bool(kept) and not req.finished

    def _resume_parked(self) -> list[Request]:
        """Samples the parked requests whose late mask is in, exactly as their step would have
        (their kept logits, masked), or runs the rest of a late jump-forward's token path."""
        ready, failed = self.grammars.resumable()
        self.fail_each(failed)
        out = [f.request for f in failed]  # their last output goes out too
        for req, parked in ready:
            before = req.num_tokens
            with self.boundary.request(req) as stage:
                stage("mask")
                if parked.resume is not None:
                    assert parked.forced is not None
                    parked.resume(parked.forced.result, stage)
                elif parked.fill is not None and parked.logits_hold(req):
                    logits = parked.logits
                    assert logits is not None
                    self.grammars.masks.apply_late(parked.fill, logits)
                    if not self.grammars.exclude(req, logits, 0):
                        self.fail_each([nothing_left(req)])
                    else:
                        sampled = failures.sample(self.sampler, logits, [req])
                        self.tokens.take(req, sampled, 0, stage)
            if req.num_tokens != before or req.finished:  # else recomputed first (preempted)
                out.append(req)
        return out

    def _resolve_grammars(self) -> list[Request]:
        """Grammars compiled (or refused), and adapters read (or refused: services/lora)."""
        failures = self.grammars.resolve()
        if self.adapters is not None:
            bad = self.adapters.resolve(self.requests.values())
            failures += [Failure(req, why, 400) for req, why in bad]
        self.fail_each(failures)
        return [f.request for f in failures]

    def _mark_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.perf_counter()
        for c in sched.chunks:
            if c.request.metrics.first_scheduled_time is None:
                c.request.metrics.first_scheduled_time = now

    def _update(
        self, sched: SchedulerOutput, sampling: list[Request], sampled: Sampled
    ) -> list[Request]:
        for c in sched.chunks:
            if not c.request.finished:
                c.request.num_computed_tokens += c.num_tokens
        now = time.perf_counter()
        for i, req in enumerate(sampling):
            if req.finished:  # failed earlier in this step
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            with self.boundary.request(req) as stage:
                self.tokens.take(req, sampled, i, stage)
        return sampling

    def _apply_kv_policies(self, sched: SchedulerOutput) -> None:
        """Bounded policies evict after each step that filled their slack; pages go back.
        Offloaded requests grow their hot set and park their cold pages."""
        ps = self.config.page_size
        for c in sched.chunks:
            req, state = c.request, c.request.kv_state
            if state is None or req.finished:
                continue
            with self.boundary.request(req) as stage:
                stage("kv_compact")
                computed, prompt = req.num_computed_tokens, req.num_prompt_tokens
                if state.impl.should_compact(state, computed, prompt, ps):
                    self.scheduler.release_pages(req, self.runner.compact(req))
                if state.tier is not None and self.offload is not None:
                    stage("kv_offload")
                    self.offload.after_step(req)

    # -- endings -------------------------------------------------------------------------------

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.metrics.finished_time = time.perf_counter()
        req.metrics.num_output_tokens = req.num_output_tokens
        self.scheduler.finish(req)
        if self.grammars.start_validation(req):
            self.validating.append(req)

    def _fail(self, req: Request, reason: str, status: int) -> None:
        """Ends one request with an error; the rest of the batch is untouched."""
        if req.finished:
            return
        req.warnings.append(reason)
        req.error_status = status
        self._finish(req, "error")

    def fail_each(self, failures: list[Failure]) -> None:
        for f in failures:
            self._fail(f.request, f.reason, f.status)

    def check_fault(self, stage: str, req: Request) -> None:
        if self.boundary.faults is not None:
            self.boundary.faults.check(stage, req)

    def _validated(self) -> list[Request]:
        """Requests whose output validation has its verdict (their last output can go)."""
        if not self.validating:
            return []
        done = []
        for req in self.validating:
            verdict = self.grammars.finish_validation(req)
            if isinstance(verdict, Rollback):  # back to the value that failed its check
                self.grammars.rewind(req, verdict)
                self.scheduler.add(req)
            elif verdict:
                done.append(req)
        self.validating = [r for r in self.validating if r.validation is not None]
        return done

    def fail_all(self, reason: str) -> None:
        """Ends every request with an error (503: try again); the engine is empty afterwards."""
        for req in list(self.requests.values()):
            req.validation = None
            if req.finished:
                continue
            try:
                self._fail(req, reason, 503)
            except Exception:  # the engine is broken: the request must still end
                log.exception("failing request %s", req.request_id)
                req.status, req.finish_reason = RequestStatus.FINISHED, "error"
        self.validating = []

    # -- outputs out ---------------------------------------------------------------------------

    def make_output(self, req: Request) -> RequestOutput:
        """A delta since the last call for this request, with the text and tokens so far."""
        return req.output()

    def contained_output(self, req: Request) -> RequestOutput:
        """`make_output`, or where making it fails, a last output ending this request alone
        with an error (what the serving loops hand out)."""
        try:
            self.check_fault("output", req)
            return self.make_output(req)
        except Exception as exc:
            log.warning("request %s: output failed (%r)", req.request_id, exc)
            return self.error_output(req, f"output: internal error ({exc!r})"[:300])

    def error_output(self, req: Request, reason: str) -> RequestOutput:
        """A last output for a request whose own output could not be made (nothing of its
        state is read but what is plain data)."""
        self._fail(req, reason, 500)
        if req.finish_reason != "error":
            req.warnings.append(reason)
        req.validation = None
        return req.error_output()

    def release(self, request_id: str) -> None:
        """Forgets a finished request once its last output was taken."""
        req = self.requests.get(request_id)
        if req is not None and req.done:
            del self.requests[request_id]
