"""What of the decode graphs runs without a GPU: the padded sizes, the choice of a size, which
steps qualify, and the static buffers a step is copied into (padding rows on their own page).
The graphs' forward over those buffers against eager steps: the integration test of that name."""

from __future__ import annotations

import pytest
import torch

from kvcache import native
from kvcache.batch import SeqSlice
from kvcache.pages import KVLayout, PagedKVCache
from kvcache.policies import ReadPlan
from services.engine.decode_graphs import DecodeGraphs, bucket_for, capture_sizes


def test_sizes_are_vllms_buckets_up_to_the_largest_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    sizes = capture_sizes(128)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 127, 128)] == [1, 4, 8, 16, 128, 128]
    assert bucket_for(129, sizes) is None


@pytest.fixture
def graphs(tmp_path) -> DecodeGraphs:
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    kv = PagedKVCache(layout, 32, torch.device("cpu"))
    kv.kernel = native.load(tmp_path)
    assert kv.kernel is not None
    return DecodeGraphs(kv, max_rows=8, max_pages=6, forward=lambda *a: a[0], capture=False)


def test_only_plain_decode_steps_qualify(graphs):
    pages = graphs.kv.allocator.allocate(3)
    decode = [SeqSlice(pages, 9, 1)]
    assert graphs.why_not(decode, all_sample=True, extras=False) is None
    assert graphs.why_not([SeqSlice(pages, 5, 4)], True, False) == "not a decode step"
    assert graphs.why_not(decode, all_sample=False, extras=False) == "not a decode step"
    assert graphs.why_not(decode, True, extras=True) == "adapters or prompt log-probabilities"
    quest = [SeqSlice(pages, 9, 1, plan=ReadPlan(quest_pages=2))]
    assert graphs.why_not(quest, True, False) == "a KV policy"
    assert graphs.why_not(decode * 9, True, False) == "more rows than the largest size"
    long = [SeqSlice(list(range(7)), 25, 1)]
    assert graphs.why_not(long, True, False) == "a context longer than the page tables"
    graphs.kv.kernel = None
    assert graphs.why_not(decode, True, False) == "no kernel reading pages in place"


def test_a_step_fills_the_static_buffers_and_pads_on_its_own_page(graphs):
    held = graphs.pad_page
    assert held not in graphs.kv.allocator.allocate(graphs.kv.allocator.num_free)
    a, b = [3, 9], [5, 6, 7]
    # row a: its 7th entry (page 9, offset 2); row b: its 10th (page 7, offset 1)
    graphs._fill([SeqSlice(a, 6, 1, pos_start=6), SeqSlice(b, 9, 1, pos_start=9)], [11, 22], 4)
    assert graphs.input_ids[0, :4].tolist() == [11, 22, 0, 0]
    assert graphs.positions[0, :4].tolist() == [6, 9, 0, 0]
    assert graphs.slots[:4].tolist() == [9 * 4 + 2, 7 * 4 + 1, held * 4, held * 4]
    assert graphs.starts[:4].tolist() == [6, 9, 0, 0]
    assert graphs.num_queries[:4].tolist() == [1, 1, 1, 1]  # padding rows read their own key
    assert graphs.table[0, :3].tolist() == [3, 9, held] and graphs.table[1, :3].tolist() == b
    assert graphs.table[2, :3].tolist() == [held] * 3
    batch = graphs._batch(4)
    (short,) = batch.short
    assert short.in_place(graphs.kv)  # every row through the kernel, no gather
    assert short.page_index.view(4, -1).shape == (4, 6)
