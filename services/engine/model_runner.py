"""Runs the model over a step's packed tokens and returns the logits of the rows that sample."""

from __future__ import annotations

import logging

import torch

from kvcache import attention
from kvcache.batch import SeqSlice, build_paged_batch
from kvcache.pages import KVLayout, PagedKVCache
from services.engine.config import EngineConfig
from services.engine.scheduler import ScheduledChunk
from services.models import LoadedModel, load_model

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


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
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
        self.kv = PagedKVCache(layout, layout.pages_for_budget(budget), self.device)
        log.info(
            "KV pool: %d pages of %d tokens (%.1f MiB, %d bytes per token)",
            self.kv.num_pages,
            layout.page_size,
            self.kv.capacity_bytes / 2**20,
            layout.bytes_per_token,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits `[S, vocab]` for the chunks that sample, in their order."""
        seqs = [SeqSlice(c.request.pages, c.start, c.num_tokens) for c in chunks]
        token_ids: list[int] = []
        sample_rows: list[int] = []
        for c in chunks:
            token_ids.extend(c.request.token_ids[c.start : c.start + c.num_tokens])
            if c.samples:
                sample_rows.append(len(token_ids) - 1)
        if self.model.config._attn_implementation != self._attn:
            # another user of this model object (a peer in a benchmark, a test) switched it back
            self.model.set_attn_implementation(self._attn)
        batch, position_ids = build_paged_batch(self.kv, seqs)
        input_ids = torch.tensor([token_ids], device=self.device)
        keep = torch.tensor(sample_rows, device=self.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            paged_batch=batch,
        )
        return out.logits[0]
