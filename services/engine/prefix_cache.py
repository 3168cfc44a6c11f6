"""Prefix caching for the engine's requests: which pages a request maps, which it offers.

The pages and their keys live in `kvcache.prefix`; this file decides, per request:
- its scope, at admission: the key chain's root names the tenant and the request's `cache_salt`,
  so no tenant ever maps another's pages (no hit, so no timing signal either) and a salt keeps a
  prefix private within its tenant. A request whose KV policy rewrites its pages (`window`,
  `sinks`, `h2o`, `snapkv`: `Policy.shares_pages`) has no root: it neither reads nor feeds.
- what it maps, before its first chunk (and before its recompute after a preemption): its
  longest cached run of full pages, short of its last token, which is always computed so that its
  logits exist. A request asking for prompt logprobs maps nothing (they need every prompt row),
  nor does an offloaded Quest request: the pages it mapped would all be resident, where it keeps
  only a few (it still feeds the cache with the pages not yet parked when they are offered).
- whether it waits: when the page after its cached run is one a running request is computing now
  (a burst of requests with one new system prompt), it stays queued until that page is cached
  rather than computing the same prefix beside it (SGLang's in-batch prefix check). It never
  waits on itself or on nothing: the page is in a running request's prompt, so it comes.
- what it offers: each full page once its tokens are computed (every step, and when its pages go
  back, unless it failed). Only pool pages are offered: a page an offloaded request parked in the
  host tier is named by a host slot and is never keyed, so it is never served as resident.
A mapped page is shared, never written: the request computes from the page after it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvcache.pages import PagedKVCache
from kvcache.prefix import PrefixCachingAllocator, extend_keys, refresh_bounds, root_key
from services.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner

RUNNING = RequestStatus.RUNNING


class PrefixCache:
    def __init__(self, kv: PagedKVCache, model: str) -> None:
        if not isinstance(kv.allocator, PrefixCachingAllocator):
            raise TypeError("the KV pool needs a PrefixCachingAllocator")
        self.kv = kv
        self.allocator: PrefixCachingAllocator = kv.allocator
        self.page_size = kv.page_size
        self.model = model  # names the weights, KV dtype, page size and position scheme
        self.queried: Counter[str] = Counter()  # prompt tokens looked up, per tenant
        self.hit: Counter[str] = Counter()  # of which served from the cache
        self.waits = 0  # admissions put off for a page another request was computing
        self._coming: dict[bytes, Request] = {}  # prompt pages running requests compute now

    @classmethod
    def for_runner(cls, runner: ModelRunner) -> PrefixCache:
        loaded, kv = runner.loaded, runner.kv
        # positions are token indices under every policy that shares pages (no re-rotation)
        return cls(kv, f"{loaded.name}|{loaded.path}|{kv.layout.dtype}|{kv.page_size}|positions")

    def scope(self, req: Request) -> None:
        """At admission: the request's root, or none when its KV policy rewrites pages."""
        state = req.kv_state
        if state is None or state.impl.shares_pages:
            req.cache_root = root_key(self.model, req.tenant, req.params.cache_salt, req.lora_scope)

    def step(self, running: list[Request]) -> None:
        """At the start of a step: pages the last one filled are offered, and the prompt pages
        still being computed are noted (see `map`)."""
        self._coming.clear()
        for req in running:
            self.offer(req)
            self._note_coming(req)

    def _note_coming(self, req: Request) -> None:
        full = req.num_prompt_tokens // self.page_size
        if req.cache_root is None or req.keyed_pages >= full:
            return
        extend_keys(req.page_keys, req.cache_root, req.token_ids, self.page_size, full)
        self._coming.update(dict.fromkeys(req.page_keys[req.keyed_pages : full], req))

    def map(self, req: Request) -> int | None:
        """Maps the request's cached prefix into its empty page table; the tokens it covers, or
        None when it should wait for a page a running request is computing."""
        root = req.cache_root
        if root is None or req.pages or req.num_computed_tokens or req.params.prompt_logprobs:
            return 0
        if req.kv_state is not None and req.kv_state.tier is not None:
            return 0  # offloaded: mapped pages would all be resident, what the tier avoids
        usable = (req.num_tokens - 1) // self.page_size  # the last token is always computed
        extend_keys(req.page_keys, root, req.token_ids, self.page_size, usable)
        pages = self.allocator.match(req.page_keys[:usable])
        if len(pages) < usable:
            producer = self._coming.get(req.page_keys[len(pages)])
            if producer is not None and producer is not req and producer.status is RUNNING:
                self.waits += 1
                return None
        if pages:
            self.allocator.acquire(pages)
            req.pages = pages
            req.num_computed_tokens = len(pages) * self.page_size
            req.keyed_pages = len(pages)
        return req.num_computed_tokens

    def unmap(self, req: Request) -> None:
        """Undoes `map` for a request that stays waiting (its references go back)."""
        if req.pages:
            self.allocator.free(req.pages)
        req.pages, req.num_computed_tokens, req.keyed_pages = [], 0, 0

    def admitted(self, req: Request, cached: int) -> None:
        """The request runs with `cached` tokens mapped: counted, and Quest's bounds made good
        (the page may have been written by a request that kept none)."""
        if req.metrics.num_preemptions == 0:  # counted once, on the prompt
            self.queried[req.tenant] += req.num_prompt_tokens
            self.hit[req.tenant] += min(cached, req.num_prompt_tokens)
            req.metrics.num_cached_tokens = min(cached, req.num_prompt_tokens)
        state = req.kv_state
        if cached and state is not None and state.impl.keeps_bounds:
            refresh_bounds(self.kv, req.pages[: cached // self.page_size])
        self._note_coming(req)  # those admitted after it in this step wait for its pages

    def offer(self, req: Request) -> None:
        """Keys the request's full pages whose tokens are all computed."""
        if req.cache_root is None or req.finish_reason == "error":
            return
        full = min(req.num_computed_tokens // self.page_size, len(req.pages))
        if full <= req.keyed_pages:
            return
        extend_keys(req.page_keys, req.cache_root, req.token_ids, self.page_size, full)
        for i in range(req.keyed_pages, full):
            page = req.pages[i]
            if page < self.allocator.num_pages:  # past the pool: a parked page's host slot
                self.allocator.register(page, req.page_keys[i])
        req.keyed_pages = full

    def released(self, req: Request) -> None:
        """Its pages went back: the next `map` starts from an empty table."""
        req.keyed_pages = 0
