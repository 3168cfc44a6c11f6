"""KV policies on hand-made tensors: Quest's bound, the kept positions of each evicting policy,
re-rotation, and the attention paths (Quest with every page, explicit weights) against SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvcache.attention import BoundsUpdate, CollectRead, _collecting_attention, _update_bounds
from kvcache.pages import KVLayout, PagedKVCache
from kvcache.policies import compact, new_state
from kvcache.prefix import refresh_bounds
from kvcache.quest_read import QuestRead, quest_page_scores
from kvcache.quest_read import attention as quest_attention
from services.engine.model_runner import _rotate_half
from services.engine.params import KVPolicy

LAYERS, KVH, G, D, PS = 2, 2, 3, 8, 4


def make_cache(num_pages: int = 32, bound_splits: int = 1) -> PagedKVCache:
    layout = KVLayout(LAYERS, KVH, D, PS, torch.float32)
    return PagedKVCache(layout, num_pages, torch.device("cpu"), bound_splits=bound_splits)


def fill(kv: PagedKVCache, pages: list[int], n: int) -> torch.Tensor:
    """Random keys and values for n tokens of `pages`; returns the keys `[L, KVH, n, D]`. The
    pages are zeroed first, as the allocator does when it hands a page out (the pool is
    uninitialised memory: a NaN in a masked slot would still reach the output)."""
    kv._zero_pages(pages)
    keys = torch.randn(LAYERS, KVH, n, D)
    for t in range(n):
        slot = pages[t // PS] * PS + t % PS
        kv.keys[:, :, slot] = keys[:, :, t]
        kv.values[:, :, slot] = keys[:, :, t] * 10  # values remember where the key was
    return keys


def cached_keys(kv: PagedKVCache, pages: list[int], n: int) -> torch.Tensor:
    slots = [pages[t // PS] * PS + t % PS for t in range(n)]
    return kv.keys[:, :, slots]


def scored_cache(
    seed: int,
) -> tuple[PagedKVCache, list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """20 random tokens in 5 scattered pages, their slots and random scores to edit and store."""
    torch.manual_seed(seed)
    kv = make_cache()
    kv.ensure_scores()
    pages = [4, 1, 7, 2, 9]
    keys = fill(kv, pages, 20)
    slots = torch.tensor([pages[t // PS] * PS + t % PS for t in range(20)])
    return kv, pages, keys, slots, torch.rand(LAYERS, KVH, 20)


def rows(bounds: torch.Tensor) -> torch.Tensor:
    """[P, KVH, D] page bounds -> [50, KVH, P, D], the same pages for each of 50 query rows."""
    return bounds.transpose(0, 1)[None].expand(50, -1, -1, -1)


def test_quest_bound_is_an_upper_bound_of_every_logit_in_the_page():
    torch.manual_seed(0)
    keys = torch.randn(50, KVH, 6, D)  # 50 pages of 6 keys
    q = torch.randn(50, KVH, G, D)
    lo, hi = keys.amin(dim=2), keys.amax(dim=2)  # [P, KVH, D]
    # every one of the 50 query rows scores all 50 pages: bounds [R, KVH, P, D]
    bound = quest_page_scores(q, rows(lo), rows(hi))
    # bound[r, h, p] >= q[r, h, g] . k for every key k of page p and every query head g
    logits = torch.einsum("rhgd,phkd->rhpgk", q, keys)  # [R, KVH, P, G, 6]
    assert (bound[..., None, None] >= logits - 1e-5).all()
    # and tight for a single-key page: equals the largest q.k across the group
    single = keys[:, :, :1]
    b1 = quest_page_scores(q, rows(single[:, :, 0]), rows(single[:, :, 0]))
    exact = torch.einsum("rhgd,phd->rhpg", q, single[:, :, 0]).amax(-1)
    torch.testing.assert_close(b1, exact, rtol=1e-5, atol=1e-5)


def test_quest_gqa_keeps_a_page_only_one_query_head_wants():
    # KV head 0: page 1 matters to query head 2 only; the others prefer page 0 mildly
    q = torch.zeros(1, 1, G, D)
    q[0, 0, :2, 0] = 1.0
    q[0, 0, 2, 1] = 1.0
    lo = torch.zeros(1, 1, 2, D)
    hi = torch.zeros(1, 1, 2, D)
    hi[0, 0, 0, 0] = 1.0  # page 0: 1.0 for heads 0 and 1
    hi[0, 0, 1, 1] = 5.0  # page 1: 5.0 for head 2 only (a mean over heads would rate it 1.67)
    scores = quest_page_scores(q, lo, hi)
    assert scores[0, 0].argmax().item() == 1


def test_quest_union_takes_each_query_heads_first_choice_before_anyones_second():
    """Head 0 bounds pages 0 and 1 far above everything; head 1's best is page 2. With k = 2,
    `max` reads pages 0 and 1 (head 1 misses its page), `union` reads 0 (head 0's first) and 2
    (head 1's first). Padding (page 3, not valid) is never chosen, whatever its bounds."""
    q = torch.zeros(1, 1, 2, D)
    q[0, 0, 0, 0] = 1.0
    q[0, 0, 1, 1] = 1.0
    lo = torch.zeros(1, 1, 4, D)
    hi = torch.zeros(1, 1, 4, D)
    hi[0, 0, 0, 0], hi[0, 0, 1, 0] = 9.0, 8.0  # head 0: pages 0, 1
    hi[0, 0, 2, 1] = 1.0  # head 1: page 2
    hi[0, 0, 3, :] = 99.0  # padding
    valid = torch.tensor([[True, True, True, False]])
    top2 = {
        union: set(quest_page_scores(q, lo, hi, valid, union)[0, 0].topk(2).indices.tolist())
        for union in (False, True)
    }
    assert top2 == {False: {0, 1}, True: {0, 2}}
    assert quest_page_scores(q, lo, hi, valid, True)[0, 0, 3] == float("-inf")


def _bounds(kv: PagedKVCache, pages: list[int], keys: torch.Tensor) -> None:
    n = keys.shape[2]
    for layer in range(LAYERS):
        tokens = torch.arange(n)
        page_of = torch.tensor([pages[t // PS] for t in range(n)])
        fresh = torch.tensor([pages[t // PS] for t in range(0, n, PS)])
        _update_bounds(kv, layer, keys[layer], BoundsUpdate(tokens, page_of, fresh))


def test_quest_with_every_page_selected_equals_dense_attention():
    torch.manual_seed(1)
    kv = make_cache()
    kv.ensure_bounds()
    pages = [5, 2, 9, 7, 11]
    n = 18  # the last page is partial
    keys = fill(kv, pages, n)
    _bounds(kv, pages, keys)
    q = torch.randn(1, KVH * G, 1, D)
    read = QuestRead(torch.tensor([pages]), torch.tensor([5]), torch.tensor([n]), 5, 0)
    out = quest_attention(kv, 1, q, read, None)
    k = cached_keys(kv, pages, n)[1][None]  # [1, KVH, n, D]
    v = k * 10
    dense = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_quest_reads_the_best_pages_and_always_the_last():
    kv = make_cache()
    kv.ensure_bounds()
    pages = [3, 4, 6, 8]
    keys = torch.zeros(LAYERS, KVH, 16, D)
    keys[:, :, 4:8, 0] = 3.0  # page 1 holds keys aligned with the query
    for t in range(16):
        kv.keys[:, :, pages[t // PS] * PS + t % PS] = keys[:, :, t]
    _bounds(kv, pages, keys)
    q = torch.zeros(1, KVH * G, 1, D)
    q[..., 0] = 1.0
    # budget 2 pages: page 1 (the best bound) and page 3 (the last), not 0 or 2
    kv.values.zero_()
    for p, marker in zip(pages, [1.0, 2.0, 3.0, 4.0], strict=True):
        kv.values[:, :, p * PS : (p + 1) * PS] = marker
    read = QuestRead(torch.tensor([pages]), torch.tensor([4]), torch.tensor([16]), 2, 0)
    out = quest_attention(kv, 0, q, read, None)
    # softmax over page 1 (logits 3/sqrt(D)) and page 3 (logits 0): values 2 and 4 only
    w = math.exp(3 / math.sqrt(D)) / (math.exp(3 / math.sqrt(D)) + 1)
    expected = 2.0 * w + 4.0 * (1 - w)
    torch.testing.assert_close(out, torch.full_like(out, expected))


def test_bounds_per_part_hold_each_parts_min_and_max():
    """Two bound cells per page: folding keys in (decode and prefill) and rebuilding them from
    the pool (prefix cache) give each half page's channel-wise min and max."""
    torch.manual_seed(3)
    kv = make_cache(bound_splits=2)
    kv.ensure_bounds()
    pages = [6, 3, 10]
    keys = fill(kv, pages, 3 * PS)
    half = PS // 2
    for layer in range(LAYERS):
        cells = torch.tensor([pages[t // PS] * 2 + (t % PS) // half for t in range(3 * PS)])
        fresh = kv.bound_cells(torch.tensor(pages)).flatten()
        _update_bounds(kv, layer, keys[layer], BoundsUpdate(torch.arange(3 * PS), cells, fresh))
    parts = keys.view(LAYERS, KVH, 6, half, D)
    cells = kv.bound_cells(torch.tensor(pages)).flatten()
    assert torch.equal(kv.bounds_min[:, :, cells], parts.amin(dim=3))
    assert torch.equal(kv.bounds_max[:, :, cells], parts.amax(dim=3))
    folded = kv.bounds_min.clone(), kv.bounds_max.clone()
    kv.bounds_min.zero_(), kv.bounds_max.zero_()
    refresh_bounds(kv, pages)
    assert torch.equal(kv.bounds_min, folded[0]) and torch.equal(kv.bounds_max, folded[1])


@pytest.mark.parametrize(("splits", "page"), [(1, 1), (2, 0)])
def test_bounds_per_part_find_the_key_a_whole_page_bound_blurs(splits, page):
    """q = e0 + e1. Page 0's keys are 1.5 e0 + 1.5 e1 (q·k = 3); page 1 holds 2 e0 in its first
    half and 2 e1 in its second (q·k = 2), yet its whole-page bound is 4. With a budget of one
    page beside the last, one bound per page reads page 1 (the decoy), two per page page 0."""
    kv = make_cache(bound_splits=splits)
    kv.ensure_bounds()
    pages = [3, 4, 6]  # the third is the last (always read; its keys are 0)
    keys = torch.zeros(LAYERS, KVH, 3 * PS, D)
    keys[:, :, 0:PS, :2] = 1.5
    keys[:, :, PS : PS + PS // 2, 0] = 2.0
    keys[:, :, PS + PS // 2 : 2 * PS, 1] = 2.0
    kv.values.zero_()
    for t in range(3 * PS):
        kv.keys[:, :, pages[t // PS] * PS + t % PS] = keys[:, :, t]
    for p, marker in zip(pages, [1.0, 2.0, 0.0], strict=True):
        kv.values[:, :, p * PS : (p + 1) * PS] = marker
    cells = torch.tensor([pages[t // PS] * splits + (t % PS) * splits // PS for t in range(3 * PS)])
    fresh = kv.bound_cells(torch.tensor(pages)).flatten()
    _update_bounds(kv, 0, keys[0], BoundsUpdate(torch.arange(3 * PS), cells, fresh))
    q = torch.zeros(1, KVH * G, 1, D)
    q[..., :2] = 1.0
    read = QuestRead(torch.tensor([pages]), torch.tensor([3]), torch.tensor([3 * PS]), 2, 0)
    out = quest_attention(kv, 0, q, read, None)
    # softmax over the chosen page (its logit) and the last page (logit 0): its marker only
    logit = (3.0 if page == 0 else 2.0) / math.sqrt(D)
    expected = [1.0, 2.0][page] * math.exp(logit) / (math.exp(logit) + 1)
    torch.testing.assert_close(out, torch.full_like(out, expected))


def test_collecting_attention_matches_sdpa_and_sums_softmax_columns():
    torch.manual_seed(2)
    kv = make_cache()
    kv.ensure_scores()
    q = torch.randn(1, KVH * G, 5, D)
    k = torch.randn(1, KVH, 12, D)
    v = torch.randn(1, KVH, 12, D)
    mask = (torch.arange(12)[None, :] <= torch.arange(7, 12)[:, None])[None, None]
    slots = torch.arange(40, 52)
    weights = torch.ones(1, 5)
    out = _collecting_attention(
        kv, 0, q, k, v, mask, CollectRead("accumulate", slots[None], weights, 1), None
    )
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(G, 1)) / math.sqrt(D)
    p = logits.masked_fill(~mask, -math.inf).softmax(-1)  # [1, H, 5, 12]
    per_kv_head = p.sum(2).view(KVH, G, 12).sum(1)  # summed over queries and the group
    torch.testing.assert_close(kv.scores[0][:, 40:52], per_kv_head, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (KVPolicy(kind="window", budget_tokens=8), list(range(12, 20))),
        (KVPolicy(kind="sinks", budget_tokens=8, n_sink=3), [0, 1, 2, 15, 16, 17, 18, 19]),
    ],
)
def test_window_and_sinks_keep_their_positions(policy, expected):
    torch.manual_seed(3)
    kv = make_cache()
    pages = [4, 1, 7, 2, 9]
    keys = fill(kv, pages, 20)
    state = new_state(policy, PS)
    freed = compact(kv, state, list(pages), 20, 20)
    assert freed == pages[2:]  # 8 tokens = 2 pages kept
    assert state.evicted == 12
    torch.testing.assert_close(cached_keys(kv, pages, 8), keys[:, :, expected])


def test_h2o_keeps_heavy_hitters_per_head_and_the_recent_window():
    kv, pages, keys, slots, scores = scored_cache(seed=4)
    heavy = {(0, 0): [3, 9], (0, 1): [0, 5], (1, 0): [11, 2], (1, 1): [7, 8]}
    for (layer, head), idx in heavy.items():
        scores[layer, head, idx] = 10.0
    kv.scores[:, :, slots] = scores
    state = new_state(KVPolicy(kind="h2o", budget_tokens=8, heavy_ratio=0.25), PS)
    compact(kv, state, list(pages), 20, 20)
    kept = cached_keys(kv, pages, 8)
    for (layer, head), idx in heavy.items():
        positions = sorted(idx) + list(range(14, 20))  # 2 heavy + 6 recent, in order
        torch.testing.assert_close(kept[layer, head], keys[layer, head, positions])
    # scores travel with their tokens: the next eviction ranks by the same accumulated votes
    torch.testing.assert_close(kv.scores[0, 0, slots[:2]], torch.tensor([10.0, 10.0]))


def test_snapkv_keeps_top_voted_positions_and_its_observation_window():
    kv, pages, keys, slots, scores = scored_cache(seed=5)
    scores[:, :, 6] = 5.0
    scores[:, 1, 2] = 6.0
    kv.scores[:, :, slots] = scores
    state = new_state(KVPolicy(kind="snapkv", budget_tokens=6, window=4), PS)
    assert state.impl.should_compact(state, 20, 20, PS)
    compact(kv, state, list(pages), 20, 20)
    kept = cached_keys(kv, pages, 6)
    for layer in range(LAYERS):
        top0 = sorted(scores[layer, 0, :16].topk(2).indices.tolist())
        assert 6 in top0
        torch.testing.assert_close(kept[layer, 0], keys[layer, 0, [*top0, 16, 17, 18, 19]])
        torch.testing.assert_close(kept[layer, 1], keys[layer, 1, [2, 6, 16, 17, 18, 19]])


def test_rerotation_moves_keys_to_their_new_positions():
    torch.manual_seed(6)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))

    def rope(x, pos):
        freqs = pos[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        return x * emb.cos() + _rotate_half(x) * emb.sin()

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", inv_freq)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.rotary_emb = Rotary()

    from services.engine.model_runner import rope_rotation

    rotate = rope_rotation(Model())
    raw = torch.randn(LAYERS, KVH, 20, D)  # pre-RoPE keys of tokens 0..19
    kv = make_cache()
    pages = [4, 1, 7, 2, 9]
    for t in range(20):
        kv.keys[:, :, pages[t // PS] * PS + t % PS] = rope(raw[:, :, t], torch.tensor([t]))
    state = new_state(KVPolicy(kind="sinks", budget_tokens=8, n_sink=2, rerotate=True), PS)
    compact(kv, state, list(pages), 20, 20, rotate)
    kept = [0, 1, 14, 15, 16, 17, 18, 19]
    expected = rope(raw[:, :, kept], torch.arange(8))  # now at cache positions 0..7
    torch.testing.assert_close(cached_keys(kv, pages, 8), expected, rtol=1e-4, atol=1e-4)
    assert state.position(20) == 8  # the next token goes right after the cache


def test_snapkv_vote_of_the_last_queries_alone_equals_the_masked_full_vote():
    from kvcache.attention import _observe

    torch.manual_seed(7)
    n, w = 40, 6
    q = torch.randn(1, KVH * G, n, D)
    k = torch.randn(1, KVH, n, D)
    v = torch.randn(1, KVH, n, D)
    slots = torch.arange(n)
    weights = (torch.arange(n) >= n - w).float()
    full, part = make_cache(), make_cache()
    for kv in (full, part):
        kv.ensure_scores()
    causal = (torch.arange(n)[None, :] <= torch.arange(n)[:, None])[None, None]
    _collecting_attention(
        full, 0, q, k, v, causal, CollectRead("observe", slots[None], weights[None], 5), None
    )
    _observe(part, 0, q, k, v, None, CollectRead("observe", slots, weights, 5, w), None)
    torch.testing.assert_close(part.scores[0], full.scores[0])
    assert full.scores[0, :, :n].sum() > 0
