"""Builds a step's `PagedBatch`: where new keys go and which pages each query reads.

Index tensors are built on the host in one pass and moved to the device together, once per step;
every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.attention import LongQuery, PagedBatch, ShortQueries
from kvcache.pages import PagedKVCache, pages_needed

# Queries longer than this run one attention call each (a prompt chunk); shorter ones are batched.
LONG_QUERY_THRESHOLD = 32


@dataclass(frozen=True)
class SeqSlice:
    """Tokens `[start, start + num_tokens)` of a sequence whose pages are `pages`."""

    pages: list[int]
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def _slot_mapping(seqs: list[SeqSlice], page_size: int) -> torch.Tensor:
    slots: list[int] = []
    for s in seqs:
        for pos in range(s.start, s.end):
            slots.append(s.pages[pos // page_size] * page_size + pos % page_size)
    return torch.tensor(slots, dtype=torch.long)


def _causal_mask(starts: torch.Tensor, qmax: int, kmax: int, nq: torch.Tensor) -> torch.Tensor:
    """[B, 1, qmax, kmax]: query j of row b sees keys 0..starts[b] + j; padded queries see key 0."""
    q_pos = starts[:, None] + torch.arange(qmax)[None, :]  # [B, qmax]
    k_pos = torch.arange(kmax)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    padded = torch.arange(qmax)[None, :] >= nq[:, None]
    mask[padded] = k_pos == 0  # keeps softmax finite on rows that are thrown away
    return mask[:, None]


def _short_queries(seqs: list[SeqSlice], offsets: list[int], page_size: int) -> ShortQueries:
    nq = torch.tensor([s.num_tokens for s in seqs])
    qmax = int(nq.max())
    base = torch.tensor(offsets)
    j = torch.arange(qmax)
    valid = j[None, :] < nq[:, None]
    token_index = base[:, None] + torch.minimum(j[None, :], nq[:, None] - 1)
    npages = [pages_needed(s.end, page_size) for s in seqs]
    pmax = max(npages)
    page_index = torch.zeros(len(seqs), pmax, dtype=torch.long)
    for row, (s, n) in enumerate(zip(seqs, npages, strict=True)):
        page_index[row, :n] = torch.tensor(s.pages[:n])
    starts = torch.tensor([s.start for s in seqs])
    mask = _causal_mask(starts, qmax, pmax * page_size, nq)
    return ShortQueries(token_index, valid, page_index, mask)


def _long_query(s: SeqSlice, offset: int, page_size: int) -> LongQuery:
    if s.start == 0:
        return LongQuery(offset, offset + s.num_tokens, None, None)
    n = pages_needed(s.end, page_size)
    page_index = torch.tensor(s.pages[:n])
    nq = torch.tensor([s.num_tokens])
    mask = _causal_mask(torch.tensor([s.start]), s.num_tokens, n * page_size, nq)
    return LongQuery(offset, offset + s.num_tokens, page_index, mask)


def build_paged_batch(
    kv: PagedKVCache, seqs: list[SeqSlice], long_threshold: int = LONG_QUERY_THRESHOLD
) -> tuple[PagedBatch, torch.Tensor]:
    """The batch metadata and the `[1, T]` position ids of the packed tokens."""
    ps = kv.page_size
    offsets: list[int] = []
    positions: list[int] = []
    offset = 0
    for s in seqs:
        offsets.append(offset)
        positions.extend(range(s.start, s.end))
        offset += s.num_tokens
    short_rows = [i for i, s in enumerate(seqs) if s.num_tokens <= long_threshold]
    long_rows = [i for i, s in enumerate(seqs) if s.num_tokens > long_threshold]
    short = None
    if short_rows:
        short = _short_queries([seqs[i] for i in short_rows], [offsets[i] for i in short_rows], ps)
    long = [_long_query(seqs[i], offsets[i], ps) for i in long_rows]
    batch = PagedBatch(kv, _slot_mapping(seqs, ps), short, long)
    return _to_device(batch, kv.device), torch.tensor([positions], device=kv.device)


def _to_device(batch: PagedBatch, device: torch.device) -> PagedBatch:
    if device.type == "cpu":
        return batch

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    short = batch.short
    if short is not None:
        parts = (short.token_index, short.valid, short.page_index, short.mask)
        short = ShortQueries(*(move(t) for t in parts))  # type: ignore[arg-type]
    long = [LongQuery(q.start, q.end, move(q.page_index), move(q.mask)) for q in batch.long]
    return PagedBatch(batch.kv, move(batch.slot_mapping), short, long)  # type: ignore[arg-type]
