"""Decode steps replayed as CUDA graphs: one launch for the whole forward instead of a few
hundred kernel launches from Python, which is where a small model's decode step spends its time
on a GPU (vLLM and SGLang capture the same way).

A graph replays fixed shapes from fixed addresses, so a decode step is padded to the next of a
few batch sizes (`capture_sizes`: 1, 2, 4, then every multiple of 8, as vLLM picks them) and its
metadata is copied into static buffers the captured forward reads: token ids, positions, the
slot each new key is written to, each row's page table, cache position and query count.
Attention reads the pages in place (the Triton kernel: its loop bounds come from those buffers,
so one graph serves any context length up to `max_pages`). Padding rows compute a token of their
own on a page reserved for them, which no request ever holds. Grammar masks, sampling and
everything after the logits stay outside the graph, as in an eager step.

Only plain decode steps qualify (`why_not`): one token per row, no drafts, no KV policy, no
adapter, no prompt log-probabilities, and a kernel that reads the pages in place; any other step
runs eagerly, as does every step with `decode_graphs="off"` (the plain twin). Graphs are
captured on first use of a size. `decode_graphs="uncaptured"` runs the same padded forward over
the same static buffers without capturing: what a CPU runs to prove the graphs' inputs right.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcache.attention import PagedBatch, ShortQueries, stepping
from kvcache.batch import SeqSlice
from kvcache.pages import PagedKVCache

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def capture_sizes(max_rows: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, then multiples of 8, up to `max_rows` (included)."""
    sizes = [s for s in (1, 2, 4) if s < max_rows]
    sizes += range(8, max_rows, 8)
    return [*sizes, max_rows]


def bucket_for(rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest size holding `rows`, or None when none does."""
    return next((s for s in sizes if s >= rows), None)


class DecodeGraphs:
    def __init__(
        self, kv: PagedKVCache, max_rows: int, max_pages: int, forward: Forward, capture: bool
    ) -> None:
        self.kv, self.forward, self.capture = kv, forward, capture
        self.sizes = capture_sizes(max_rows)
        self.max_pages = max_pages
        self.pad_page = kv.allocator.allocate(1)[0]  # held for good: padding rows' own page
        rows, dev = self.sizes[-1], kv.device

        def static(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=dev)

        self.input_ids, self.positions = static(1, rows), static(1, rows)
        self.slots, self.starts, self.num_queries = static(rows), static(rows), static(rows)
        self.table = static(rows, max_pages)
        self.index = torch.arange(rows, device=dev)  # offsets, rows kept, packed indices
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # torch.cuda.graph_pool_handle(), shared by every size
        self.replayed = self.uncaptured = 0  # steps run each way (the device check reads them)

    def why_not(self, seqs: Sequence[SeqSlice], all_sample: bool, extras: bool) -> str | None:
        """None when this step can run padded through the static buffers, else why not.
        `extras`: adapters or prompt log-probabilities in the step."""
        kernel = self.kv.kernel
        if kernel is None or not kernel.reads(self.kv.keys.dtype, False):
            return "no kernel reading pages in place"
        if extras:
            return "adapters or prompt log-probabilities"
        if not all_sample or any(s.num_tokens != 1 for s in seqs):
            return "not a decode step"
        if any(s.plan is not None for s in seqs):
            return "a KV policy"
        if len(seqs) > self.sizes[-1]:
            return "more rows than the largest size"
        if any(len(s.pages) > self.max_pages for s in seqs):
            return "a context longer than the page tables"
        return None

    @torch.inference_mode()
    def run(self, seqs: Sequence[SeqSlice], token_ids: Sequence[int]) -> torch.Tensor:
        """Logits `[len(seqs), vocab]` of a decode step (`why_not` said None)."""
        n = len(seqs)
        size = bucket_for(n, self.sizes)
        assert size is not None
        self._fill(seqs, token_ids, size)
        if not self.capture:
            self.uncaptured += 1
            return self._forward(size)[:n]
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        self.replayed += 1
        return self.outputs[size][:n]

    def _fill(self, seqs: Sequence[SeqSlice], token_ids: Sequence[int], size: int) -> None:
        """This step's rows, then padding rows up to `size`, into the static buffers."""
        n, ps = len(seqs), self.kv.page_size
        pad = size - n
        widest = max(len(s.pages) for s in seqs)
        table = torch.full((size, widest), self.pad_page, dtype=torch.long)
        for r, s in enumerate(seqs):
            table[r, : len(s.pages)] = torch.tensor(s.pages)
        slots = [s.pages[s.start // ps] * ps + s.start % ps for s in seqs]
        slots += [self.pad_page * ps] * pad
        host = torch.tensor(
            [
                [*token_ids, *[0] * pad],
                [*(s.first_position for s in seqs), *[0] * pad],
                slots,
                [*(s.start for s in seqs), *[0] * pad],
            ]
        )
        bufs = (self.input_ids[0], self.positions[0], self.slots, self.starts)
        for buf, row in zip(bufs, host, strict=True):
            buf[:size].copy_(row, non_blocking=True)
        self.num_queries[:size].fill_(1)
        self.table[:size, :widest].copy_(table, non_blocking=True)

    def _batch(self, size: int) -> PagedBatch:
        """The step's metadata as views of the static buffers (every row reads through the
        kernel: no masks, no gather indices)."""
        index = self.index[:size]
        short = ShortQueries(
            token_index=index[:, None],
            src_index=index,
            dst_index=index,
            page_index=self.table[:size].flatten(),
            mask=torch.empty(0, dtype=torch.bool, device=index.device),
            starts=self.starts[:size],
            offsets=index,
            num_queries=self.num_queries[:size],
        )
        return PagedBatch(self.kv, self.slots[:size], [short], [])

    def _forward(self, size: int) -> torch.Tensor:
        with stepping(self._batch(size)):
            return self.forward(
                self.input_ids[:, :size], self.positions[:, :size], self.index[:size]
            )

    def _capture(self, size: int) -> None:
        """Warm up on a side stream (lazy initialisations, Triton's compile), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (the KV tier's copies) does not void a capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[size] = self._forward(size)
        self.graphs[size] = graph
        log.info("decode graph captured for %d rows", size)
