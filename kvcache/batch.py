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
# Short queries are grouped by context length so that padding stays under this share of the pages
# read; more groups mean more (smaller) kernel calls, so their number is capped.
PAD_SLACK = 1.25
MAX_GROUPS = 8


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
    """[R, 1, qmax, kmax]: query j of row r sees keys 0..starts[r] + j; padded queries see key 0."""
    q_pos = starts[:, None] + torch.arange(qmax)[None, :]  # [R, qmax]
    k_pos = torch.arange(kmax)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    padded = torch.arange(qmax)[None, :] >= nq[:, None]
    mask[padded] = k_pos == 0  # keeps softmax finite on rows that are thrown away
    return mask[:, None]


def group_by_length(
    npages: list[int], slack: float = PAD_SLACK, max_groups: int = MAX_GROUPS
) -> list[list[int]]:
    """Row indices in groups of similar page counts, each padded by at most `slack`."""
    order = sorted(range(len(npages)), key=npages.__getitem__)
    while True:
        groups: list[list[int]] = []
        current: list[int] = []
        total = 0
        for r in order:
            p = npages[r]
            if current and p * (len(current) + 1) > slack * (total + p):
                groups.append(current)
                current, total = [], 0
            current.append(r)
            total += p
        groups.append(current)
        if len(groups) <= max_groups:
            return groups
        slack *= 1.5


def _short_queries(seqs: list[SeqSlice], offsets: list[int], page_size: int) -> ShortQueries:
    nq = torch.tensor([s.num_tokens for s in seqs])
    qmax = int(nq.max())
    j = torch.arange(qmax)
    valid = (j[None, :] < nq[:, None]).flatten()
    token_index = torch.tensor(offsets)[:, None] + torch.minimum(j[None, :], nq[:, None] - 1)
    src_index = valid.nonzero().squeeze(-1)
    dst_index = token_index.flatten()[src_index]
    npages = [pages_needed(s.end, page_size) for s in seqs]
    pmax = max(npages)
    page_index = torch.zeros(len(seqs), pmax, dtype=torch.long)
    for row, (s, n) in enumerate(zip(seqs, npages, strict=True)):
        page_index[row, :n] = torch.tensor(s.pages[:n])
    starts = torch.tensor([s.start for s in seqs])
    mask = _causal_mask(starts, qmax, pmax * page_size, nq)
    return ShortQueries(token_index, src_index, dst_index, page_index.flatten(), mask)


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
    groups = (
        group_by_length([pages_needed(seqs[i].end, ps) for i in short_rows]) if short_rows else []
    )
    short = [
        _short_queries(
            [seqs[short_rows[g]] for g in group], [offsets[short_rows[g]] for g in group], ps
        )
        for group in groups
    ]
    long = [_long_query(seqs[i], offsets[i], ps) for i in long_rows]
    batch = PagedBatch(kv, _slot_mapping(seqs, ps), short, long)
    return _to_device(batch, kv.device), torch.tensor([positions], device=kv.device)


def _to_device(batch: PagedBatch, device: torch.device) -> PagedBatch:
    if device.type == "cpu":
        return batch

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    short = [
        ShortQueries(
            *(move(t) for t in (s.token_index, s.src_index, s.dst_index, s.page_index, s.mask))
        )
        for s in batch.short
    ]
    long = [
        LongQuery(
            q.start,
            q.end,
            None if q.page_index is None else move(q.page_index),
            None if q.mask is None else move(q.mask),
        )
        for q in batch.long
    ]
    return PagedBatch(batch.kv, move(batch.slot_mapping), short, long)
