"""The KV host tier: park + read_cells round trips (bit-exact), slot ownership, caps, counters."""

import pickle

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvcache.host_slots import HostSlotError, HostSlots, HostTierFull
from kvcache.host_tier import HostPageStore
from kvcache.pages import KVLayout, PagedKVCache

CPU = torch.device("cpu")
A1, A2, B1 = ("a", "r1"), ("a", "r2"), ("b", "r1")  # B1 reuses A1's request id in tenant b


def layout(dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, dtype=dtype)


def pool(lay: KVLayout, num_pages: int = 12, seed: int = 0) -> PagedKVCache:
    kv = PagedKVCache(lay, num_pages, CPU)
    gen = torch.Generator().manual_seed(seed)
    kv.keys.copy_(torch.randn(kv.keys.shape, generator=gen).to(lay.dtype))
    kv.values.copy_(torch.randn(kv.values.shape, generator=gen).to(lay.dtype))
    return kv


def page(kv: PagedKVCache, p: int, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of device page `p`, `[L, KVH, ps, D]` (or one layer), as copies."""
    ps, sel = kv.page_size, slice(None) if layer is None else layer
    window = slice(p * ps, (p + 1) * ps)
    return kv.keys[sel, :, window].clone(), kv.values[sel, :, window].clone()


def cells_of(store: HostPageStore, slots: list[int]) -> torch.Tensor:
    """Every KV head of each slot, head-major: `read_cells` rows `[KVH * n]`."""
    heads = torch.arange(store.layout.num_kv_heads)[:, None]
    return (heads * store.capacity_pages + torch.tensor(slots)[None, :]).flatten()


def read_pages(store: HostPageStore, slots: list[int], layer: int) -> tuple[torch.Tensor, ...]:
    """Keys and values of `slots` at `layer` read back through `read_cells`, `[n, KVH, ps, D]`."""
    lay = store.layout
    out = store.read_cells(layer, cells_of(store, slots))
    return tuple(t.view(lay.num_kv_heads, len(slots), *t.shape[1:]).transpose(0, 1) for t in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_park_then_read_every_layer_is_bit_exact(dtype):
    lay = layout(dtype)
    kv, store = pool(lay), HostPageStore(lay, 8, CPU)
    src = [1, 5, 2, 9]
    originals = [page(kv, p) for p in src]
    slots = store.park(kv, src, A1)
    kv.keys.zero_()  # nothing may come back from the device pool itself
    kv.values.zero_()
    for layer in range(lay.num_layers):
        keys, values = read_pages(store, slots, layer)
        for i, (k, v) in enumerate(originals):
            assert torch.equal(keys[i], k[layer]) and torch.equal(values[i], v[layer])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("staging", [1, 3])
def test_the_staged_path_runs_on_a_cpu_and_reads_what_the_direct_path_does(dtype, staging):
    """The GPU's copies through staging, in pieces of `staging` pages (a park of 5 pages, a read
    of 5 pages x 2 heads: several pieces each), run synchronously here: the same bytes back."""
    lay = layout(dtype)
    kv = pool(lay)
    direct, staged = HostPageStore(lay, 8, CPU), HostPageStore(lay, 8, CPU, staging_pages=staging)
    assert direct.staging_pages == 0 and staged.staging_pages == staging
    src = [4, 1, 7, 2, 9]
    slots = [store.park(kv, src, A1) for store in (direct, staged)]
    assert slots[0] == slots[1]
    for layer in range(lay.num_layers):
        want = read_pages(direct, slots[0][::-1], layer)
        got = read_pages(staged, slots[1][::-1], layer)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))


def test_pinning_refused_falls_back_to_pageable_memory(caplog):
    """No accelerator here: pinned memory is refused, and the store works from pageable memory,
    saying so (on CUDA the same call pins)."""
    lay = layout()
    store = HostPageStore(lay, 4, CPU, pin_memory=True)
    assert store.pinned == torch.cuda.is_available()
    if not store.pinned:
        assert "pinned memory refused" in caplog.text
    kv = pool(lay)
    slots = store.park(kv, [3], A1)
    keys, _ = read_pages(store, slots, 0)
    assert torch.equal(keys[0], page(kv, 3, layer=0)[0])


def test_read_order_follows_the_cell_list():
    lay = layout()
    kv, store = pool(lay), HostPageStore(lay, 8, CPU)
    slots = store.park(kv, [2, 3], A1)
    want = page(kv, 3, layer=0)
    keys, values = read_pages(store, slots[::-1], 0)  # the slot of page 3 first
    assert torch.equal(keys[0], want[0]) and torch.equal(values[0], want[1])


class CountCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_copies_are_batched_not_per_page():
    lay = layout()
    calls = []
    for n in (1, 7):
        kv, store = pool(lay), HostPageStore(lay, 8, CPU)
        with CountCalls() as park_ops:
            slots = store.park(kv, list(range(n)), A1)
        with CountCalls() as read_ops:
            store.read_cells(1, cells_of(store, slots))
        calls.append((park_ops.calls, read_ops.calls))
    assert calls[0] == calls[1]  # the same torch calls for 1 page as for 7


def test_double_free_and_foreign_slots_raise():
    lay = layout()
    kv, store = pool(lay), HostPageStore(lay, 8, CPU)
    mine = store.park(kv, [1, 2], A1)
    theirs = store.park(kv, [3], B1)
    for intruder in (A2, B1):  # same tenant other request; other tenant same request id
        with pytest.raises(HostSlotError, match="held by another owner") as err:
            store.free(intruder, mine[:1])
        assert repr(A1) not in str(err.value)  # the holder is never named
    with pytest.raises(HostSlotError):
        store.free(A1, [mine[0], theirs[0]])  # all-or-nothing: mine[0] stays held
    assert store.owner_pages(A1) == 2
    store.free(A1, mine[:1])
    with pytest.raises(HostSlotError, match="free"):
        store.free(A1, mine[:1])
    with pytest.raises(HostSlotError, match="repeated"):
        store.free(A1, [mine[1], mine[1]])
    with pytest.raises(HostSlotError, match="out of range"):
        store.free(A1, [99])


def test_release_returns_everything_and_counts_reach_zero():
    lay = layout()
    kv, store = pool(lay), HostPageStore(lay, 8, CPU)
    store.reserve(A1, 5)
    store.park(kv, [1, 2, 3], A1)
    store.park(kv, [4], A2)
    assert store.tenant_pages("a") == 6 and store.pages_in_use == 4
    assert store.release(A1) == 3
    assert store.owner_pages(A1) == 0 and store.tenant_pages("a") == 1
    assert store.release(A2) == 1 and store.release(A2) == 0
    assert store.pages_in_use == 0 and store.host_bytes_in_use == 0
    assert store.tenant_pages("a") == 0 and store.can_allocate("a", 8)


def test_tenant_cap_and_capacity_raise_with_the_numbers():
    lay = layout()
    kv = pool(lay)
    store = HostPageStore(lay, 6, CPU, tenant_caps={"a": 3}, default_tenant_cap=5)
    store.park(kv, [1, 2], A1)
    assert store.can_allocate("a", 1) and not store.can_allocate("a", 2)
    with pytest.raises(HostTierFull) as err:
        store.park(kv, [3, 4], A2)
    e = err.value
    assert (e.tenant, e.asked, e.held, e.cap, e.scope) == ("a", 2, 2, 3, "tenant cap")
    assert "'a'" in str(e) and "2 held of 3" in str(e)
    assert store.owner_pages(A2) == 0  # nothing half-parked
    copy = pickle.loads(pickle.dumps(e))
    assert (copy.asked, copy.cap, str(copy)) == (2, 3, str(e))
    # tenant b: its default cap of 5 allows 4, but only 4 slots are left
    assert store.can_allocate("b", 4) and not store.can_allocate("b", 5)
    store.park(kv, [3, 4, 5, 6], B1)
    with pytest.raises(HostTierFull) as err:
        store.allocate(("c", "x"), 1)
    e = err.value
    assert (e.tenant, e.asked, e.held, e.cap, e.scope) == ("c", 1, 6, 6, "capacity")
    assert "6" not in str(e)  # another tenant's refusal does not reveal what the others hold
    assert not store.can_allocate("c", 1)
    store.release(B1)
    assert store.can_allocate("c", 4) and store.can_allocate("a", 1)


def test_reservation_is_held_for_its_owner():
    store = HostSlots(4, default_tenant_cap=3)  # the accounting alone: no arena, no tensors
    store.reserve(A1, 3)
    assert not store.can_allocate("a", 1) and not store.can_allocate("b", 2)
    with pytest.raises(HostTierFull, match="tenant cap"):
        store.reserve(A2, 1)
    assert len(store.allocate(A1, 3)) == 3  # drawn from the reservation: no new headroom needed
    with pytest.raises(HostTierFull):
        store.allocate(A1, 1)
    assert store.tenant_pages("a") == 3 and store.can_allocate("b", 1)


def test_counters_follow_page_arithmetic():
    lay = layout()
    kv, store = pool(lay), HostPageStore(lay, 8, CPU)
    assert store.read_latency_ms(50) is None and store.hit_rate is None
    seen: list[float] = []
    store.on_read = seen.append
    slots = store.park(kv, [1, 2, 3], A1)
    assert store.pages_parked == 3 and store.bytes_to_host == 3 * lay.bytes_per_page
    assert store.host_bytes_in_use == 3 * lay.bytes_per_page
    for layer in range(lay.num_layers):  # every layer and head of 2 pages: 2 whole pages
        read_pages(store, slots[:2], layer)
    assert store.pages_recalled == 2 and store.bytes_to_device == 2 * lay.bytes_per_page
    read_pages(store, slots, 0)  # a third of 3 pages: one more full-page equivalent
    assert store.cells_recalled == 2 * 3 * 2 + 3 * 2 and store.pages_recalled == 3
    assert store.bytes_to_device == 3 * lay.bytes_per_page
    p50, p99 = store.read_latency_ms(50), store.read_latency_ms(99)
    assert p50 is not None and p99 is not None and 0 <= p50 <= p99
    assert len(seen) == lay.num_layers + 1 and all(s >= 0 for s in seen)  # seconds, one per read
    store.record_hits(6, 2)
    store.record_hits(0, 2)
    assert store.hit_rate == pytest.approx(0.6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_cells_returns_one_head_of_one_layer_of_each_parked_page(dtype):
    lay = layout(dtype)
    kv, store = pool(lay), HostPageStore(lay, 8, CPU)
    src = [3, 7, 5]
    originals = [page(kv, p) for p in src]
    slots = store.park(kv, src, A1)
    cap = store.capacity_pages
    wanted = [(2, 1, 0), (0, 0, 2), (1, 1, 2), (2, 0, 0)]  # (layer, head, index into src)
    for layer in range(lay.num_layers):
        picks = [(h, i) for lay_, h, i in wanted if lay_ == layer]
        if not picks:
            continue
        cells = torch.tensor([h * cap + slots[i] for h, i in picks])
        keys, values = store.read_cells(layer, cells)
        assert keys.shape == (len(picks), lay.page_size, lay.head_dim)
        for row, (h, i) in enumerate(picks):
            assert torch.equal(keys[row], originals[i][0][layer, h])
            assert torch.equal(values[row], originals[i][1][layer, h])
    assert store.cells_recalled == len(wanted)
    cell_bytes = lay.bytes_per_page // (lay.num_layers * lay.num_kv_heads)
    assert store.bytes_to_device == len(wanted) * cell_bytes


def test_bad_arguments_are_refused():
    lay = layout()
    kv, store = pool(lay), HostPageStore(lay, 8, CPU)
    store.park(kv, [1, 2], A1)
    with pytest.raises(ValueError, match="out of range"):
        store.park(kv, [12], A1)
    with pytest.raises(ValueError, match="does not match"):
        store.park(pool(layout(torch.bfloat16)), [1], A1)
    with pytest.raises(ValueError, match="capacity_pages"):
        HostPageStore(lay, 0, CPU)
    with pytest.raises(ValueError, match="'a'"):
        HostPageStore(lay, 4, CPU, tenant_caps={"a": -1})
    with pytest.raises(ValueError, match="n: must be >= 0"):
        store.allocate(A1, -1)
    assert store.pages_in_use == 2 and store.owner_pages(A1) == 2  # refusals allocate nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_through_pinned_staging():
    lay, dev = layout(torch.bfloat16), torch.device("cuda")
    kv = PagedKVCache(lay, 64, dev)
    kv.keys.copy_(torch.randn(kv.keys.shape, device=dev).to(lay.dtype))
    kv.values.copy_(torch.randn(kv.values.shape, device=dev).to(lay.dtype))
    store = HostPageStore(lay, 48, dev, staging_pages=4)  # 10 pages: several staging chunks
    assert store.keys.is_pinned()
    src = list(range(10))
    want = [page(kv, p) for p in src]
    slots = store.park(kv, src, A1)
    kv.keys.zero_()  # what comes back comes from the host arena
    kv.values.zero_()
    # both heads of the 10 pages twice over, as cells: 40 cells, more than staging holds (24)
    cap = store.capacity_pages
    cells = torch.tensor([h * cap + s for h in (0, 1) for s in slots] * 2)
    for layer in range(lay.num_layers):
        keys, values = store.read_cells(layer, cells)
        assert keys.device.type == "cuda"
        order = [(h, i) for h in (0, 1) for i in range(len(src))] * 2
        want_k = torch.stack([want[i][0][layer, h] for h, i in order])
        want_v = torch.stack([want[i][1][layer, h] for h, i in order])
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    torch.cuda.synchronize()
    assert store.read_latency_ms(50) is not None
