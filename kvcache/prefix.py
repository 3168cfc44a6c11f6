"""Automatic prefix caching: full pages keyed by a hash chain over their tokens, shared while in
use, kept after their last user until the memory is wanted.

Page `i` of a sequence is keyed `k_i = H(k_{i-1} || its page_size token ids)`, with `k_{-1}` the
sequence's root: `H` of everything else its keys and values depend on (the model, the KV dtype and
page size, the position scheme) and of its isolation scope (the tenant, and a `cache_salt` the
request may add). Two sequences share a page only when they agree on the scope and on every token
up to the page's end. `H` is BLAKE2b-128: a collision would serve another sequence's keys, so
Python's `hash` (64 bits, seeded per process) will not do.

`PrefixCachingAllocator` counts references to pages. A keyed page whose last reference goes keeps
its key and joins an LRU of evictable pages; `allocate` hands out free pages first, then evicts
from the LRU's old end. Cached pages therefore cost only memory nobody else asks for, and the
scheduler, which sees them as free, takes them back before it preempts anyone.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Callable

import torch

from kvcache.pages import OutOfPages, PageAllocator, PagedKVCache

Key = bytes


def root_key(model: str, tenant: str, cache_salt: str | None, adapter: str | None = None) -> Key:
    """The chain's start: `model` names the weights, KV dtype, page size and position scheme;
    a LoRA `adapter` changes every layer's keys and values, so it scopes the chain too."""
    parts = [model, tenant, cache_salt] + ([adapter] if adapter is not None else [])
    scope = json.dumps(parts).encode()  # unambiguous: no separator games
    return hashlib.blake2b(scope, digest_size=16).digest()


def extend_keys(
    keys: list[Key], root: Key, token_ids: list[int], page_size: int, num_pages: int
) -> None:
    """Extends `keys` to the keys of the first `num_pages` pages of `token_ids` (all full)."""
    prev = keys[-1] if keys else root
    for i in range(len(keys), min(num_pages, len(token_ids) // page_size)):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", token_ids[i * page_size : (i + 1) * page_size]).tobytes())
        prev = h.digest()
        keys.append(prev)


class PrefixCachingAllocator(PageAllocator):
    """Pages with a reference count, an index of keyed pages, and an LRU of those unused."""

    def __init__(
        self, num_pages: int, on_first_use: Callable[[list[int]], None] | None = None
    ) -> None:
        super().__init__(num_pages, on_first_use)
        self._key_of: dict[int, Key] = {}
        self._page_of: dict[Key, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.evictions = 0  # keyed pages handed out for other contents

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Keyed pages, in use or evictable."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def match(self, keys: list[Key]) -> list[int]:
        """The pages of the longest run of `keys`, from the first, that are cached."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """One more reference to each cached page (an evictable one is in use again)."""
        for p in pages:
            if p not in self._key_of:
                raise RuntimeError(f"page {p} is not cached")
            if not self._refs[p]:
                del self._evictable[p]
            self._refs[p] += 1

    def register(self, page: int, key: Key) -> None:
        """Keys a page in use whose tokens are all computed. The first page for a key stays
        the cached one (a duplicate computed beside it is freed as any page)."""
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} is not in use")
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def _take(self, n: int) -> list[int]:
        take = min(n, len(self._free))
        pages = super()._take(take)
        while len(pages) < n:
            if not self._evictable:  # pragma: no cover - `allocate` checked num_free
                raise OutOfPages(f"asked for {n} pages")
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self.evictions += 1
            pages.append(page)
        return pages

    def _released(self, page: int) -> None:
        if page in self._key_of:
            self._evictable[page] = None  # most recently used end
        else:
            super()._released(page)


@torch.inference_mode()  # the pool and the bounds are inference tensors
def refresh_bounds(kv: PagedKVCache, pages: list[int]) -> None:
    """Quest's per-page key bounds recomputed from the keys of full pages (a cached page may
    have been written by a request that kept no bounds)."""
    if not pages:
        return
    kv.ensure_bounds()
    ps, lay = kv.page_size, kv.layout
    ids = torch.tensor(pages, device=kv.device)
    slots = (ids[:, None] * ps + torch.arange(ps, device=kv.device)).reshape(-1)
    keys = kv.keys.index_select(2, slots)  # [layers, KVH, n * ps, D]
    parts = len(pages) * kv.bound_splits  # each page's parts in order: its bound cells
    keys = keys.view(lay.num_layers, lay.num_kv_heads, parts, ps // kv.bound_splits, lay.head_dim)
    cells = kv.bound_cells(ids).flatten()
    kv.bounds_min.index_copy_(2, cells, keys.amin(dim=3))
    kv.bounds_max.index_copy_(2, cells, keys.amax(dim=3))
