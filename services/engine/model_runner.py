"""Runs the model over a step's packed tokens and returns the logits of the rows that sample."""

from __future__ import annotations

import contextlib
import logging

import torch

from kvcache import attention, native, policies, variants
from kvcache.batch import SeqSlice, build_paged_batch
from kvcache.native import AttentionKernel
from kvcache.pages import KVLayout, PageAllocator, PagedKVCache
from kvcache.prefix import PrefixCachingAllocator
from services import settings
from services.engine.config import EngineConfig
from services.engine.decode_graphs import DecodeGraphs
from services.engine.request import Request
from services.engine.scheduler import ScheduledChunk
from services.lora.layers import LoRASlots, lora_tokens
from services.models import LoadedModel, fused, load_model, packed
from services.models.loader import folder_dtype, stored_dtype

log = logging.getLogger(__name__)


def _kv_layout(config: object, page_size: int, dtype: torch.dtype) -> KVLayout:
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[attr-defined]
    return KVLayout(
        num_layers=config.num_hidden_layers,  # type: ignore[attr-defined]
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )


def attention_kernel(name: str, device: torch.device, dtype: torch.dtype) -> AttentionKernel | None:
    """The kernel that reads KV pages in place (`RunnerConfig.attention_kernel`), or None: the
    gather path. "auto" picks C on a CPU (float32, bfloat16) and Triton on CUDA, and falls back
    to the gather path (logged) where either is missing; a kernel named where it cannot run is
    refused."""
    triton = name == "triton" or (name == "auto" and device.type == "cuda")
    if triton:
        try:
            from kvcache.triton_attention import TritonPagedKernel
        except ImportError as exc:
            if name == "triton":
                raise ValueError(f"attention_kernel: triton: {exc}") from exc
            log.warning("Triton unavailable (%s): attention gathers pages", exc)
            return None
        kernel = TritonPagedKernel()
        return kernel if kernel.reads(dtype, False) else None
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        if name == "native":
            raise ValueError("attention_kernel: native reads float32 or bfloat16 pages on a CPU")
        return None
    return native.load(settings.cache_dir() / "kernels")


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.device = config.torch_device()
        stored = stored_dtype(loaded.model.config) if loaded else folder_dtype(config.model)
        self.dtype = config.torch_dtype(self.device, stored)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self._attn = attn = attention.register()
        if loaded is None:
            loaded = load_model(config.model, device=self.device, dtype=self.dtype)
        loaded.model.to(device=self.device, dtype=self.dtype)
        loaded.model.set_attn_implementation(attn)
        self.loaded = loaded
        self.model = loaded.model
        layout = _kv_layout(self.model.config, config.page_size, self.dtype)
        budget = config.kv_budget_bytes(self.device)
        allocator = PrefixCachingAllocator if config.enable_prefix_caching else PageAllocator
        splits = config.page_size // (config.quest_bound_tokens or config.page_size)
        pages = layout.pages_for_budget(budget)
        self.kv = PagedKVCache(layout, pages, self.device, allocator, bound_splits=splits)
        if config.inplace_attention:
            self.kv.kernel = attention_kernel(config.attention_kernel, self.device, self.dtype)
        log.info(
            "KV pool: %d pages of %d tokens (%.1f MiB, %d bytes per token)",
            self.kv.num_pages,
            layout.page_size,
            self.kv.capacity_bytes / 2**20,
            layout.bytes_per_token,
        )

        with packed.sibling_inputs(self.model) as siblings:
            self.attention = self._probe()
        # the small products are given whenever they build (engines may share the model); each
        # engine's forward chooses them (`_products`)
        small = (
            packed.small_products(settings.cache_dir() / "kernels")
            if config.packed_weights and self.device.type == "cpu"
            else None
        )
        self.packed = config.packed_weights and packed.pack_linears(self.model, siblings, small) > 0
        self.small_products = config.small_products and small is not None
        self.rotate = rope_rotation(self.model)
        self.fused: fused.FusedForward | None = None
        if config.fused_forward:
            plain = not self.attention.layers
            lean = fused.for_model(self.model, plain, settings.cache_dir() / "kernels")
            self.fused = lean if lean is not None and self._agrees(lean) else None
        # LoRA slots wrap the target linears last, over their packed products
        self.lora = (
            LoRASlots(self.model, config.max_loras, config.max_lora_rank, config.lora_stacked)
            if config.enable_lora
            else None
        )
        self.graphs = self._decode_graphs(config)

    def _decode_graphs(self, config: EngineConfig) -> DecodeGraphs | None:
        mode, ps = config.decode_graphs, self.kv.page_size
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return None
        if self.kv.kernel is None:
            log.info("decode graphs: off (attention gathers pages)")
            return None
        context = config.max_model_len or getattr(self.model.config, "max_position_embeddings", 0)
        max_pages = min(-(-(context or self.kv.num_pages * ps) // ps), self.kv.num_pages)
        forward = self.fused or self._transformers_forward
        return DecodeGraphs(self.kv, config.max_num_seqs, max_pages, forward, mode == "auto")

    @torch.inference_mode()
    def _probe(self) -> variants.AttentionProfile:
        """One token through every layer (into page 0, which nothing holds yet): what each
        layer's attention asks for. A model needing more than the paged attention implements
        is refused here, at load, rather than giving wrong tokens later."""
        config = self.model.config
        batch, position_ids = build_paged_batch(self.kv, [SeqSlice([0], 0, 1)])
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        try:
            with variants.probing() as profile, attention.stepping(batch):
                self.model(
                    input_ids=ids,
                    position_ids=position_ids,
                    use_cache=False,
                    logits_to_keep=1,
                )
        except variants.UnsupportedAttention as exc:
            raise ValueError(f"model: {config.model_type}: {exc}") from exc
        if profile.calls != config.num_hidden_layers:
            raise ValueError(
                f"model: {config.model_type}: {profile.calls} of its {config.num_hidden_layers} "
                "layers call the attention interface; the paged attention needs every one"
            )
        if described := profile.describe():
            context = getattr(config, "max_position_embeddings", 0) or 0
            saving = profile.window_saving(config.num_hidden_layers, context)
            log.info(
                "attention: %s; at a %d-token context %.0f%% of the KV lies outside the windows "
                "(kept: every layer holds every page)",
                described,
                context,
                100 * saving,
            )
        return profile

    @torch.inference_mode()
    def _agrees(self, lean: fused.FusedForward) -> bool:
        """A few tokens (into page 0, as `_probe`) through transformers' forward and the lean
        one: their logits must agree, or the lean forward is not used for this model."""
        n = min(4, self.kv.page_size)
        ids = torch.arange(100, 100 + n, device=self.device)[None]
        keep = torch.arange(n, device=self.device)
        logits = []
        for forward in (self._transformers_forward, lean):
            batch, position_ids = build_paged_batch(self.kv, [SeqSlice([0], 0, n)])
            try:
                with attention.stepping(batch), self._products():
                    logits.append(forward(ids, position_ids, keep).float())
            except Exception:  # a module of another shape than Llama's: keep transformers'
                if forward is self._transformers_forward:
                    raise
                log.warning("fused forward: failed on this model; not used", exc_info=True)
                return False
        tolerance = 1e-3 if self.dtype == torch.float32 else 5e-2
        scale = logits[0].abs().max().item()
        agree = torch.allclose(logits[1], logits[0], rtol=0, atol=tolerance * max(scale, 1.0))
        if not agree:
            log.warning("fused forward: its logits differ from transformers'; not used")
        return agree

    def _transformers_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep
        )
        return out.logits[0]

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits `[S, vocab]` for the chunks that sample, in their order (1 + len(draft)
        rows for a drafted chunk).

        Chunks of requests asking for prompt log-probabilities get them recorded on the request.
        """
        seqs = [_seq_slice(c) for c in chunks]
        token_ids: list[int] = []
        slots: list[int] = []  # with LoRA on, each token's slot (-1: the base model)
        sample_rows: list[int] = []
        scored: list[tuple[Request, list[int]]] = []  # prompt tokens predicted by this step's rows
        score_rows: list[int] = []
        for c in chunks:
            offset = len(token_ids)
            token_ids.extend(c.request.token_ids[c.start : c.start + c.num_tokens])
            token_ids.extend(c.draft)  # speculative: every drafted position samples too
            if self.lora is not None:
                slots.extend([c.request.lora_slot] * (len(token_ids) - offset))
            if c.samples:
                sample_rows.extend(range(len(token_ids) - 1 - len(c.draft), len(token_ids)))
            req = c.request
            if req.params.prompt_logprobs:
                last = min(c.start + c.num_tokens, req.num_prompt_tokens - 1)
                if last > c.start:
                    score_rows.extend(range(offset, offset + last - c.start))
                    scored.append((req, req.prompt_token_ids[c.start + 1 : last + 1]))
        if self.model.config._attn_implementation != self._attn:
            # another user of this model object (a peer in a benchmark, a test) switched it back
            self.model.set_attn_implementation(self._attn)
        if self.graphs is not None:
            extras = bool(scored) or bool(slots and max(slots) >= 0)
            all_sample = all(c.samples and not c.draft for c in chunks)
            if self.graphs.why_not(seqs, all_sample, extras) is None:
                with self._products():
                    return self.graphs.run(seqs, token_ids)
        batch, position_ids = build_paged_batch(self.kv, seqs)
        input_ids = torch.tensor([token_ids], device=self.device)
        keep = torch.tensor(sample_rows + score_rows, dtype=torch.long, device=self.device)
        lora: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        forward = self.fused or self._transformers_forward
        if slots and max(slots) >= 0:  # both forwards call the projections' modules: each
            lora = lora_tokens(torch.tensor(slots, device=self.device))  # adds its delta
        with attention.stepping(batch), self._products(), lora:
            logits = forward(input_ids, position_ids, keep)
        if scored:
            _record_prompt_logprobs(logits[len(sample_rows) :], scored)
        return logits[: len(sample_rows)]

    def _products(self) -> contextlib.AbstractContextManager[None]:
        if not self.packed:
            return contextlib.nullcontext()
        return packed.packed_products(small=self.small_products)

    @torch.inference_mode()
    def compact(self, req: Request) -> list[int]:
        """Applies the request's KV policy to its cache; returns the pages it no longer needs."""
        assert req.kv_state is not None
        return policies.compact(
            self.kv,
            req.kv_state,
            req.pages,
            req.num_computed_tokens,
            req.num_prompt_tokens,
            self.rotate,
        )


def _record_prompt_logprobs(logits: torch.Tensor, scored: list[tuple[Request, list[int]]]) -> None:
    targets = torch.tensor([t for _, ids in scored for t in ids], device=logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]
    values = logprobs.tolist()
    i = 0
    for req, ids in scored:
        if req.prompt_logprobs is None:
            req.prompt_logprobs = []
        req.prompt_logprobs.extend(values[i : i + len(ids)])
        i += len(ids)


def _seq_slice(c: ScheduledChunk) -> SeqSlice:
    req, state = c.request, c.request.kv_state
    if state is None:
        return SeqSlice(req.pages, c.start, c.num_positions)
    plan = state.impl.plan(state, c.start, c.num_tokens, req.num_prompt_tokens)
    return SeqSlice(req.pages, c.start - state.evicted, c.num_tokens, state.position(c.start), plan)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_rotation(model: torch.nn.Module) -> policies.Rotate | None:
    """Moves post-RoPE keys by a position delta (StreamingLLM's re-rotation), from the model's
    own inverse frequencies: transformers no longer hands rotary tables to the cache.

    None when the model has no standard rotary embedding (`rerotate` is then refused).
    """
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        return None

    def rotate(keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        # keys [..., n, D]; R(a) R(b) = R(a + b), so rotating by delta moves position p to p + delta
        freqs = delta[:, None].float() * inv_freq.to(keys.device, torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
        k = keys.float()
        return (k * emb.cos() + _rotate_half(k) * emb.sin()).to(keys.dtype)

    return rotate
