"""The paged attention function against plain per-sequence causal attention, on random tensors."""

import pytest
import torch
import torch.nn.functional as F

from kvcache.attention import paged_attention_forward
from kvcache.batch import SeqSlice, build_paged_batch
from kvcache.pages import KVLayout, PagedKVCache

H, KVH, D, PS = 6, 2, 8, 4


class FakeLayer(torch.nn.Module):
    layer_idx = 0


def reference(q, k, v):
    """q [n, H, D] at the end of a context k, v [L, KVH, D]; causal, GQA."""
    n, ctx = q.shape[0], k.shape[0]
    kk = k.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    mask = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize("long_threshold", [32, 1000])
def test_mixed_batch_matches_per_sequence_attention(long_threshold):
    torch.manual_seed(0)
    layout = KVLayout(num_layers=1, num_kv_heads=KVH, head_dim=D, page_size=PS, dtype=torch.float32)
    kv = PagedKVCache(layout, 64, torch.device("cpu"))
    # (cached prefix, new tokens): prompt from scratch, prompt chunk after a prefix, a decode token,
    # a short multi-token extension (jump-forward), and a prefix that ends mid-page
    shapes = [(0, 40), (20, 40), (30, 1), (10, 5), (7, 1)]
    seqs, full_k, full_v, queries = [], [], [], []
    for prefix, n in shapes:
        total = prefix + n
        pages = kv.allocator.allocate(-(-total // PS))
        pages.reverse()  # pages need not be contiguous or ordered
        k, v = torch.randn(total, KVH, D), torch.randn(total, KVH, D)
        for pos in range(prefix):  # the cached prefix
            slot = pages[pos // PS] * PS + pos % PS
            kv.keys[0, :, slot], kv.values[0, :, slot] = k[pos], v[pos]
        seqs.append(SeqSlice(pages, prefix, n))
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(n, H, D))
    batch, positions = build_paged_batch(kv, seqs, long_threshold=long_threshold)
    q = torch.cat(queries).transpose(0, 1)[None]
    k_new = torch.cat([k[p:] for k, (p, _) in zip(full_k, shapes, strict=True)]).transpose(0, 1)[
        None
    ]
    v_new = torch.cat([v[p:] for v, (p, _) in zip(full_v, shapes, strict=True)]).transpose(0, 1)[
        None
    ]
    out, _ = paged_attention_forward(FakeLayer(), q, k_new, v_new, None, paged_batch=batch)
    expected = torch.cat(
        [reference(qi, k, v) for qi, k, v in zip(queries, full_k, full_v, strict=True)]
    )
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
    assert positions[0].tolist() == [t for p, n in shapes for t in range(p, p + n)]


def test_grouping_bounds_padding_and_covers_every_row():
    from kvcache.batch import group_by_length

    npages = [1, 66, 3, 40, 41, 2, 65, 10]
    groups = group_by_length(npages, slack=1.25, max_groups=8)
    assert sorted(r for g in groups for r in g) == list(range(len(npages)))
    for g in groups:
        assert max(npages[r] for r in g) * len(g) <= 1.25 * sum(npages[r] for r in g)
    assert len(group_by_length(npages, slack=1.25, max_groups=2)) <= 2
