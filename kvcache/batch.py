"""Builds a step's `PagedBatch`: where new keys go and which pages each query reads.

Index tensors are built on the host in one pass and moved to the device together, once per step;
every layer reuses them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvcache.attention import (
    BoundsUpdate,
    CollectRead,
    HostRead,
    LongQuery,
    PagedBatch,
    ShortQueries,
)
from kvcache.hot_set import HotSet
from kvcache.pages import PagedKVCache, pages_needed
from kvcache.policies import ReadPlan
from kvcache.quest_read import QuestRead

# Queries longer than this run one attention call each (a prompt chunk); shorter ones are batched.
LONG_QUERY_THRESHOLD = 32
# Short queries are grouped by context length so that padding stays under this share of the pages
# read; more groups mean more (smaller) kernel calls, so their number is capped.
PAD_SLACK = 1.25
MAX_GROUPS = 8


@dataclass(frozen=True)
class SeqSlice:
    """Cache entries `[start, start + num_tokens)` of a sequence whose pages are `pages`.

    `pos_start` is the RoPE position of the first new token (the cache index unless a policy
    evicted tokens before it); `plan` says how the row reads the cache (None: every page).
    """

    pages: list[int]
    start: int
    num_tokens: int
    pos_start: int | None = None
    plan: ReadPlan | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def first_position(self) -> int:
        return self.start if self.pos_start is None else self.pos_start


def _page_runs(s: SeqSlice, page_size: int) -> Iterator[tuple[int, int, int]]:
    """`(lo, hi, page)` for each page the new entries `[start, end)` fall in: one iteration per
    page, not per token (a 4k-token prompt chunk is 256 runs)."""
    lo = s.start
    while lo < s.end:
        hi = min(s.end, (lo // page_size + 1) * page_size)
        yield lo, hi, s.pages[lo // page_size]
        lo = hi


def _slot_mapping(seqs: list[SeqSlice], page_size: int) -> torch.Tensor:
    slots: list[int] = []
    for s in seqs:
        for lo, hi, page in _page_runs(s, page_size):
            first = page * page_size - (lo // page_size) * page_size  # slot of entry 0 of the page
            slots.extend(range(first + lo, first + hi))
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


def _host_read(page_index: torch.Tensor, num_pages: int) -> HostRead | None:
    """Parked pages among `page_index` (ids >= num_pages name host slots): where they sit in the
    flattened index and which host slots to read, and where the resident ones sit. Parked entries
    become page 0 in `page_index` (a valid id for what else reads it)."""
    flat = page_index.view(-1)
    if not flat.numel() or int(flat.max()) < num_pages:  # no host tier, or nothing parked
        return None
    is_parked = flat >= num_pages
    parked, resident = is_parked.nonzero().squeeze(-1), (~is_parked).nonzero().squeeze(-1)
    read = HostRead(parked, flat[parked] - num_pages, resident, flat[resident], flat.clone())
    flat[parked] = 0
    return read


def _short_queries(
    seqs: list[SeqSlice], offsets: list[int], page_size: int, trash: int, num_pages: int
) -> ShortQueries:
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
    plan = seqs[0].plan  # rows are grouped by plan
    quest = collect = None
    # Quest with a budget covering every page reads them all: the dense path, its exact twin
    if plan is not None and plan.quest_pages is not None and plan.quest_pages < pmax:
        ends = torch.tensor([s.end for s in seqs])
        quest = QuestRead(
            page_index.clone(),
            torch.tensor(npages),
            ends,
            plan.quest_pages,
            plan.dense_layers,
            _hot_sets(seqs) if plan.tier is not None else None,
            plan.quest_union,
        )
    if plan is not None and plan.collect is not None:
        ends = starts + nq
        key_pos = torch.arange(pmax * page_size)
        slots = page_index.repeat_interleave(page_size, dim=1) * page_size + key_pos % page_size
        # keys past the row's end (padding, page 0) score into the pool's sink slot
        key_slots = torch.where(key_pos[None, :] < ends[:, None], slots, trash)
        q_weight = _voters(nq, qmax, plan)
        collect = CollectRead(plan.collect, key_slots, q_weight, plan.kernel_size)
    host = _host_read(page_index, num_pages)
    return ShortQueries(
        token_index,
        src_index,
        dst_index,
        page_index.flatten(),
        mask,
        quest,
        collect,
        host,
        starts,
        torch.tensor(offsets),
        nq,
    )


def _hot_sets(seqs: list[SeqSlice]) -> list[HotSet]:
    """Each offloaded row's hot set (rows are grouped by plan: all of them are offloaded)."""
    hot = [s.plan.tier for s in seqs if s.plan is not None and s.plan.tier is not None]
    assert len(hot) == len(seqs)
    return hot


def _voters(nq: torch.Tensor, qmax: int, plan: ReadPlan) -> torch.Tensor:
    """[R, qmax] 1.0 for the queries whose attention weights count, else 0."""
    j = torch.arange(qmax)[None, :]
    voters = j < nq[:, None]
    if plan.collect == "observe":
        voters &= j >= nq[:, None] - plan.observe
    return voters.float()


def _long_query(s: SeqSlice, offset: int, page_size: int, trash: int, num_pages: int) -> LongQuery:
    collect = None
    if s.start == 0:
        if s.plan is not None and s.plan.collect is not None:
            slots = _slots(s, 0, s.end, page_size)
            q_weight = _voters(torch.tensor([s.num_tokens]), s.num_tokens, s.plan)[0]
            collect = _long_collect(s.plan, slots, q_weight)
        return LongQuery(offset, offset + s.num_tokens, None, None, collect)
    n = pages_needed(s.end, page_size)
    page_index = torch.tensor(s.pages[:n])
    nq = torch.tensor([s.num_tokens])
    mask = _causal_mask(torch.tensor([s.start]), s.num_tokens, n * page_size, nq)
    if s.plan is not None and s.plan.collect is not None:
        slots = torch.full((n * page_size,), trash, dtype=torch.long)
        slots[: s.end] = _slots(s, 0, s.end, page_size)
        q_weight = _voters(nq, s.num_tokens, s.plan)[0]
        collect = _long_collect(s.plan, slots, q_weight)
    host = _host_read(page_index, num_pages)
    rows = torch.tensor([[s.start], [s.num_tokens], [offset]])
    return LongQuery(offset, offset + s.num_tokens, page_index, mask, collect, host, rows)


def _long_collect(plan: ReadPlan, slots: torch.Tensor, q_weight: torch.Tensor) -> CollectRead:
    assert plan.collect is not None
    voters = min(plan.observe, q_weight.shape[0]) if plan.collect == "observe" else 0
    return CollectRead(plan.collect, slots, q_weight, plan.kernel_size, voters)


def _slots(s: SeqSlice, start: int, end: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    pages = torch.tensor(s.pages)
    return pages[pos // page_size] * page_size + pos % page_size


def _plan_key(s: SeqSlice) -> tuple[object, ...]:
    """Rows that read the cache the same way share attention calls."""
    p = s.plan
    if p is None or (p.quest_pages is None and p.collect is None):
        return ("dense",)
    tiered = p.tier is not None
    return (
        p.quest_pages,
        p.dense_layers,
        p.collect,
        p.observe,
        p.kernel_size,
        tiered,
        p.quest_union,
    )


def _bounds_update(
    seqs: list[SeqSlice], offsets: list[int], page_size: int, splits: int
) -> BoundsUpdate | None:
    """Which new keys feed Quest's bounds (each into its page's part: `PagedKVCache.bound_cells`),
    and which pages start afresh this step."""
    tokens: list[int] = []
    cells: list[int] = []
    fresh: list[int] = []
    part = page_size // splits
    for s, offset in zip(seqs, offsets, strict=True):
        if s.plan is None or not s.plan.bounds:
            continue
        for lo, hi, page in _page_runs(s, page_size):
            tokens.extend(range(offset + lo - s.start, offset + hi - s.start))
            cells.extend(page * splits + (t % page_size) // part for t in range(lo, hi))
            if lo % page_size == 0:  # a page's first key: the bounds of its last owner go
                fresh.extend(range(page * splits, (page + 1) * splits))
    if not tokens:
        return None
    return BoundsUpdate(
        torch.tensor(tokens), torch.tensor(cells), torch.tensor(fresh, dtype=torch.long)
    )


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
        positions.extend(range(s.first_position, s.first_position + s.num_tokens))
        offset += s.num_tokens
    classes: dict[tuple[object, ...], list[int]] = {}
    for i, s in enumerate(seqs):
        if s.num_tokens <= long_threshold:
            classes.setdefault(_plan_key(s), []).append(i)
    trash = kv.trash_slot
    short = [
        _short_queries(
            [seqs[rows[g]] for g in group],
            [offsets[rows[g]] for g in group],
            ps,
            trash,
            kv.num_pages,
        )
        for rows in classes.values()
        for group in group_by_length([pages_needed(seqs[i].end, ps) for i in rows])
    ]
    long = [
        _long_query(s, offsets[i], ps, trash, kv.num_pages)
        for i, s in enumerate(seqs)
        if s.num_tokens > long_threshold
    ]
    zero = [
        slot
        for s in seqs
        if s.plan is not None and s.plan.scores
        for slot in _slots(s, s.start, s.end, ps).tolist()
    ]
    if any(s.plan is not None and s.plan.scores for s in seqs):
        kv.ensure_scores()
    bounds = _bounds_update(seqs, offsets, ps, kv.bound_splits)
    if bounds is not None:
        kv.ensure_bounds()
    batch = PagedBatch(
        kv,
        _slot_mapping(seqs, ps),
        short,
        long,
        bounds,
        torch.tensor(zero, dtype=torch.long) if zero else None,
    )
    return _to_device(batch, kv.device), torch.tensor([positions], device=kv.device)


def _to_device(batch: PagedBatch, device: torch.device) -> PagedBatch:
    if device.type == "cpu":
        return batch
    return batch.to(device)
