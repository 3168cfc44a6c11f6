"""The in-place paged attention kernel (kvcache/paged_attention.c) against the plain path (pages
gathered, then SDPA) on random tensors: decode rows, multi-token spans, pages out of order,
grouped query heads, sliding windows and soft-capped logits, float32 and bfloat16 pages; and the
fallback without a compiler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcache import native
from kvcache.attention import paged_attention_forward
from kvcache.batch import SeqSlice, build_paged_batch
from kvcache.pages import KVLayout, PagedKVCache

D, PS = 16, 4


class FakeLayer(torch.nn.Module):
    layer_idx = 0


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> native.PagedKernel:
    built = native.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "the machine has a C compiler: the kernel must build"
    return built


def attend(kv: PagedKVCache, seqs, q, k, v, **variant) -> torch.Tensor:  # type: ignore[no-untyped-def]
    batch, _ = build_paged_batch(kv, seqs)
    out, _ = paged_attention_forward(FakeLayer(), q, k, v, None, paged_batch=batch, **variant)
    return out[0]


# (cached entries, new tokens): decode rows at several lengths, one ending mid-page, a
# jump-forward span, a row with nothing cached yet; and one row alone (a task per query head)
BATCH = [(30, 1), (7, 1), (1, 1), (50, 1), (10, 5), (0, 3), (17, 12)]
ALONE = [(45, 1)]


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("variant", [{}, {"sliding_window": 5}, {"softcap": 2.0}])
@pytest.mark.parametrize(
    "shapes,dim", [(BATCH, D), (ALONE, D), (BATCH, 24)], ids=["batch", "alone", "dim24"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_gather_then_sdpa(kernel, heads, kv_heads, variant, shapes, dim, dtype):
    torch.manual_seed(0)
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, page_size=PS, dtype=dtype)
    kv = PagedKVCache(layout, 96, torch.device("cpu"))
    seqs = []
    for cached, n in shapes:
        pages = kv.allocator.allocate(-(-(cached + n) // PS))
        pages.reverse()  # pages need not be contiguous or ordered
        seqs.append(SeqSlice(pages, cached, n))
    kv.keys.normal_()
    kv.values.normal_()
    t = sum(n for _, n in shapes)
    q = (torch.randn(1, heads, t, dim) * 2).to(dtype)
    k, v = (torch.randn(1, kv_heads, t, dim).to(dtype) for _ in range(2))
    kv.kernel = None
    want = attend(kv, seqs, q, k, v, **variant)
    kv.kernel = kernel
    got = attend(kv, seqs, q, k, v, **variant)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bfloat16: the kernel sums in float32, SDPA in its own order: within a bf16 step
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_no_compiler_leaves_the_plain_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert native.library.__wrapped__(native.SOURCE, tmp_path / "kernels") is None  # type: ignore[attr-defined]
