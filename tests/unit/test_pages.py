import pytest
import torch

from kvcache.pages import KVLayout, OutOfPages, PageAllocator, PagedKVCache, pages_needed


def test_allocate_and_free_round_trip():
    alloc = PageAllocator(4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 1
    with pytest.raises(OutOfPages):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 4 and alloc.num_used == 0


def test_double_free_is_caught():
    alloc = PageAllocator(2)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(pages)


@pytest.mark.parametrize(
    ("tokens", "size", "pages"), [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2)]
)
def test_pages_needed(tokens, size, pages):
    assert pages_needed(tokens, size) == pages


def test_layout_sizes_pool_from_budget():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float32)
    assert layout.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert layout.pages_for_budget(layout.bytes_per_page * 10 + 5) == 10
    cache = PagedKVCache(layout, 10, torch.device("cpu"))
    assert cache.keys.shape == (30, 3, 160, 64)
    assert cache.bytes_in_use == 0
    cache.allocator.allocate(2)
    assert cache.bytes_in_use == 2 * layout.bytes_per_page


def test_pages_are_zeroed_on_first_use_only():
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype=torch.float32)
    cache = PagedKVCache(layout, 3, torch.device("cpu"))
    cache.keys.fill_(float("nan"))
    cache.values.fill_(float("nan"))
    pages = cache.allocator.allocate(2)
    for p in pages:
        assert torch.all(cache.keys[:, :, p * 2 : p * 2 + 2] == 0)
        assert torch.all(cache.values[:, :, p * 2 : p * 2 + 2] == 0)
    cache.keys[:, :, pages[0] * 2] = 5.0  # written by a request
    cache.allocator.free(pages)
    again = cache.allocator.allocate(3)
    assert pages[0] in again
    assert torch.all(cache.keys[:, :, pages[0] * 2] == 5.0)  # reused pages are not re-zeroed
