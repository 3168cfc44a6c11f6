"""The Triton paged attention (kvcache/triton_attention.py) against the plain path (pages gathered,
then SDPA) on random pages, run here by Triton's interpreter: the kernel source a GPU compiles.

Every variant the engine uses: decode rows, jump-forward spans and a row with nothing cached,
prompt chunks over a cached prefix, grouped query heads (1, 3 and 4 per KV head), sliding
windows, soft-capped logits, Quest's per-head page choice, ragged lengths, pages out of order,
page sizes 8 and 16, float32 and bfloat16. On a machine with CUDA the same tests run the
compiled kernel on the GPU (their ids say cuda: the device check's step 1 selects them)."""

from __future__ import annotations

import pytest
import torch

from kvcache.attention import paged_attention_forward
from kvcache.batch import SeqSlice, build_paged_batch
from kvcache.pages import KVLayout, PagedKVCache
from kvcache.policies import ReadPlan
from kvcache.prefix import refresh_bounds
from services.engine.config import RunnerConfig
from services.engine.model_runner import attention_kernel

triton_attention = pytest.importorskip("kvcache.triton_attention")

D = 16
# the interpreter on a CPU; compiled, on the GPU, where there is one
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
on_device = pytest.mark.parametrize("device", [DEVICE], ids=[DEVICE.type])


class FakeLayer(torch.nn.Module):
    layer_idx = 0


def attend(kv: PagedKVCache, seqs, q, k, v, **variant) -> torch.Tensor:  # type: ignore[no-untyped-def]
    batch, _ = build_paged_batch(kv, seqs)
    keys, values = kv.keys.clone(), kv.values.clone()  # each path writes the new keys itself
    out, _ = paged_attention_forward(FakeLayer(), q, k, v, None, paged_batch=batch, **variant)
    kv.keys.copy_(keys)
    kv.values.copy_(values)
    return out[0]


def setup(shapes, heads, kv_heads, page, dtype, plan=None):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=D, page_size=page, dtype=dtype)
    kv = PagedKVCache(layout, 64, DEVICE)
    seqs = []
    for cached, n in shapes:
        pages = kv.allocator.allocate(-(-(cached + n) // page))
        pages.reverse()  # pages need not be contiguous or ordered
        seqs.append(SeqSlice(pages, cached, n, plan=plan))
    kv.keys.normal_()
    kv.values.normal_()
    t = sum(n for _, n in shapes)
    q = (torch.randn(1, heads, t, D) * 2).to(DEVICE, dtype)
    k, v = (torch.randn(1, kv_heads, t, D).to(DEVICE, dtype) for _ in range(2))
    return kv, seqs, q, k, v


class Counted(triton_attention.TritonPagedKernel):
    """The kernel, counting its calls: rows (and Quest rows) that it read."""

    def __init__(self) -> None:
        self.rows = self.quest_rows = 0

    def short(self, q, out, k, v, table, starts, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.rows += table.shape[0]
        logical = kwargs.get("logical", args[8] if len(args) > 8 else None)
        self.quest_rows += table.shape[0] if logical is not None else 0
        super().short(q, out, k, v, table, starts, *args, **kwargs)


def compare(kv, seqs, q, k, v, **variant) -> Counted:  # type: ignore[no-untyped-def]
    kv.kernel = None
    want = attend(kv, seqs, q, k, v, **variant)
    kv.kernel = kernel = Counted()
    got = attend(kv, seqs, q, k, v, **variant)
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert kernel.rows == len(seqs)  # every row through the kernel, the prompt chunk too
    return kernel


# (cached entries, new tokens): decode rows at ragged lengths (one ending mid-page, one at a
# page's first entry), a jump-forward span, a row with nothing cached, a prompt chunk over a
# cached prefix (over 32 tokens: a long query, one kernel row of its own)
ROWS = [(30, 1), (7, 1), (16, 1), (50, 1), (10, 5), (0, 3), (17, 40)]


@on_device
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("variant", [{}, {"sliding_window": 5}, {"softcap": 2.0}])
@pytest.mark.parametrize("page", [8, 16])
def test_the_kernel_equals_gather_then_sdpa(heads, kv_heads, variant, page, device):
    compare(*setup(ROWS, heads, kv_heads, page, torch.float32), **variant)


@on_device
@pytest.mark.parametrize("variant", [{}, {"sliding_window": 12}])
def test_bfloat16_within_its_tolerance(variant, device):
    compare(*setup(ROWS, 9, 3, 16, torch.bfloat16), **variant)


@on_device
@pytest.mark.parametrize("page,union", [(8, False), (16, False), (8, True)])
def test_quest_rows_read_their_chosen_pages_in_place(page, union, device):
    """Decode rows reading 2 pages per KV head (the best by key bounds, and the last) out of
    up to 7: each KV head's own choice, read where the pages lie."""
    plan = ReadPlan(quest_pages=2, bounds=True, quest_union=union)
    shapes = [(50, 1), (23, 1), (40, 1)]
    kv, seqs, q, k, v = setup(shapes, 9, 3, page, torch.float32, plan)
    kv.ensure_bounds()
    refresh_bounds(kv, [p for s in seqs for p in s.pages])
    kernel = compare(kv, seqs, q, k, v)
    assert kernel.quest_rows >= 2  # the rows with more than 2 pages chose theirs


def test_parked_pages_are_left_to_the_gather_path():
    kernel = triton_attention.TritonPagedKernel()
    assert kernel.reads(torch.bfloat16, parked=False)
    assert not kernel.reads(torch.bfloat16, parked=True)
    assert not kernel.reads(torch.int8, parked=False)


def test_tile_holds_every_query_head_of_a_kv_head():
    for group in (1, 3, 4, 7, 8, 32):
        for queries in (1, 5, 40, 512):
            block_m, block_q = triton_attention._tile(group, queries)
            assert block_m >= 16 and block_m & (block_m - 1) == 0  # tl.dot: a power of two
            assert 1 <= block_q * group <= block_m


def test_the_kernel_choice_refuses_what_cannot_run():
    cpu = torch.device("cpu")
    assert isinstance(
        attention_kernel("triton", cpu, torch.float32), triton_attention.TritonPagedKernel
    )
    assert attention_kernel("auto", cpu, torch.float16) is None  # the C kernel: fp32, bf16
    with pytest.raises(ValueError, match="attention_kernel: native"):
        attention_kernel("native", cpu, torch.float16)
    with pytest.raises(ValueError, match="attention_kernel: 'flash'"):
        RunnerConfig(attention_kernel="flash")
