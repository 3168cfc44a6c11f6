"""Paged attention in Triton: queries read the KV pool's pages where they lie, on CUDA.

The plain path (`kvcache/attention.py`) gathers every page a row reads into a workspace and runs
SDPA over the copy; on CPU a C kernel (`paged_attention.c`) reads in place instead. This is the
same reading for a GPU, and it is written in Triton rather than as a `flex_attention` block mask
because Triton's interpreter (`TRITON_INTERPRET=1`) runs this very source on a CPU: the kernel the
GPU will time is the one the CPU suite proves equal to the gather path (`flex_attention` on CPU
would run a different, compiled or reference, implementation than the GPU's). On a machine
without CUDA this module turns the interpreter on before Triton is imported: it is slow (numpy
per program), for tests, never a CPU serving path. Triton's library functions are interpreted
only when the variable is set before Triton is first imported (transformers and xgrammar import
it): the test suite sets it first thing (tests/conftest.py), and importing this module where it
came too late is an ImportError that says so.

One program serves one (row, KV head, block of queries): its G query heads (GQA) and queries
are the rows of one tile, so each key and value is read once for all heads sharing it. Keys are
visited `BLOCK_N` cache entries at a time through the row's page table (entry n lives in slot
`table[n // page] * page + n % page`), with an online softmax in float32.

What a query sees, as the gather path's masks say (`kvcache/batch.py`, `kvcache/variants.py`):
query j of row r sits at cache position `starts[r] + j` and sees positions up to its own, the
last `window` of them when the layer has a window; `softcap` passes scores through
`tanh(s / cap) * cap`. Quest rows read their own pages per KV head (`table` `[R, KVH, k]`)
and name each entry's position in the sequence (`logical`, the page's index in the row).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

if not torch.cuda.is_available() and type(tl.zeros).__name__ != "InterpretedFunction":
    raise ImportError(
        "Triton was imported before TRITON_INTERPRET=1 was set: without CUDA its kernels run "
        "only under the interpreter, which must be on before triton is first imported"
    )

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The interpreter computes half-precision arithmetic on the raw bits (wrong values; loads,
# stores and conversions are right), so interpreted tiles become float32 once loaded; compiled
# for a GPU they stay in the cache's dtype and tl.dot runs on its tensor cores.
_UPCAST = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_N = 64  # cache entries a program scores together (tl.dot wants at least 16)


@triton.jit
def _paged_attention(
    Q,  # [T, H, D] packed queries
    Out,  # [T, H, D] written for each row's queries
    K,  # [KVH, slots, D] this layer's key pool
    V,
    TABLE,  # [R, P] (shared by KV heads) or [R, KVH, P] (Quest): pool page of each entry
    LOGICAL,  # like TABLE: each entry's page index in the row (Quest); unused otherwise
    STARTS,  # [R] cache position of each row's first query
    NUMQ,  # [R] queries of each row
    OFFSETS,  # [R] packed index of each row's first query
    stride_qt,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_tr,
    stride_th,  # 0 when every KV head reads the row's table
    entries,  # pages in a Quest row's table (P)
    scale,
    window,
    softcap,
    GROUP: tl.constexpr,  # query heads per KV head
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # queries per program: BLOCK_Q * GROUP <= BLOCK_M
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    QUEST: tl.constexpr,
    UPCAST: tl.constexpr,  # float32 tiles (the interpreter: see `_UPCAST`)
    PRECISION: tl.constexpr,  # tl.dot's: "ieee" for float32 pages (no TF32 rounding), else None
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    block = tl.program_id(2)
    nq = tl.load(NUMQ + row)
    start = tl.load(STARTS + row)
    offset = tl.load(OFFSETS + row)

    m = tl.arange(0, BLOCK_M)
    qi = block * BLOCK_Q + m // GROUP  # query of each tile row
    head = kvh * GROUP + m % GROUP
    live = (m < BLOCK_Q * GROUP) & (qi < nq)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q_ptr = Q + (offset + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=live[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qpos = start + qi

    # the entries this block's queries can see: [lo, hi)
    first_q = block * BLOCK_Q
    last_q = tl.minimum(nq, first_q + BLOCK_Q) - 1
    if QUEST:
        lo = 0
        hi = entries * PAGE
    else:
        hi = start + last_q + 1
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(start + first_q - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.where(first_q < nq, hi, lo)  # a block past the row's queries reads nothing

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table = TABLE + row * stride_tr + kvh * stride_th
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        seen = n < hi
        page = tl.load(table + n // PAGE, mask=seen, other=0)
        slot = page * PAGE + n % PAGE
        kv_mask = seen[:, None] & dmask[None, :]
        k = tl.load(K + kvh * stride_kh + slot[:, None] * stride_ks + d[None, :], kv_mask, 0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # float32 [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # tanh(s / cap) * cap
        if QUEST:
            pos = tl.load(LOGICAL + row * stride_tr + kvh * stride_th + n // PAGE, seen, 0)
            pos = pos * PAGE + n % PAGE
        else:
            pos = n
        keep = seen[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            keep = keep & (pos[None, :] > qpos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kvh * stride_kh + slot[:, None] * stride_ks + d[None, :], kv_mask, 0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = Out + (offset + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=live[:, None] & dmask[None, :])


def _tile(group: int, max_queries: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): tile rows and the queries they hold, at least 16 rows (tl.dot's
    minimum), up to 64 for prompt chunks."""
    want = triton.next_power_of_2(max(group * max_queries, 16))
    block_m = max(triton.next_power_of_2(group), min(want, 64))
    return block_m, max(block_m // group, 1)


class TritonPagedKernel:
    """The Triton kernel behind the interface `kvcache/attention.py` calls (`PagedKernel`'s):
    short queries and prompt chunks over a cached prefix read pages in place; Quest rows too."""

    prompt_chunks = True  # also serves long queries over a cached prefix
    quest = True

    def reads(self, dtype: torch.dtype, parked: bool) -> bool:
        """Pages parked in the host tier live in host memory, which a GPU kernel does not read
        in place: those rows keep the gather path, which copies them in."""
        return dtype in DTYPES and not parked

    def short(
        self,
        q: torch.Tensor,  # [T, H, D] contiguous
        out: torch.Tensor,  # [T, H, D] contiguous: the rows' queries are written
        k_cache: torch.Tensor,  # [KVH, slots, D]
        v_cache: torch.Tensor,
        page_table: torch.Tensor,  # [R, P], or [R, KVH, P] with `logical`
        starts: torch.Tensor,  # [R] cache position of each row's first query
        num_queries: torch.Tensor,  # [R]
        offsets: torch.Tensor,  # [R] packed index of each row's first query
        page_size: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        host: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_queries: int = 1,
        logical: torch.Tensor | None = None,
    ) -> None:
        if host is not None:
            raise ValueError("the Triton kernel reads no parked pages (see `reads`)")
        rows = page_table.shape[0]
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[0]
        group = heads // kv_heads
        block_m, block_q = _tile(group, max_queries)
        quest = logical is not None
        table = page_table.contiguous()
        stride_th = table.stride(1) if quest else 0
        grid = (rows, kv_heads, triton.cdiv(max_queries, block_q))
        _paged_attention[grid](
            q,
            out,
            k_cache,
            v_cache,
            table,
            logical.contiguous() if logical is not None else table,
            starts,
            num_queries,
            offsets,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            table.stride(0),
            stride_th,
            table.shape[-1],
            scale,
            window or 0,
            softcap or 0.0,
            GROUP=group,
            PAGE=page_size,
            HEAD_DIM=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            HAS_WINDOW=window is not None,
            HAS_SOFTCAP=softcap is not None,
            QUEST=quest,
            UPCAST=_UPCAST,
            PRECISION="ieee" if k_cache.dtype == torch.float32 else None,
        )
