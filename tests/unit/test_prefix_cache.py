"""Prefix caching below the model: keys, the caching allocator, and the scheduler mapping and
offering pages, with a soak of random requests, aborts and preemptions that checks every page."""

import random

import pytest
import torch

from kvcache.pages import KVLayout, OutOfPages, PagedKVCache
from kvcache.policies import new_state
from kvcache.prefix import PrefixCachingAllocator, extend_keys, refresh_bounds, root_key
from services import SamplingParams
from services.engine.config import SchedulingConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.params import KVPolicy
from services.engine.prefix_cache import PrefixCache
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler, SchedulerOutput

PS = 4


def keys_of(tokens, tenant="t", salt=None, pages=None):
    keys: list[bytes] = []
    extend_keys(keys, root_key("m", tenant, salt), tokens, PS, pages or len(tokens) // PS)
    return keys


def test_keys_chain_over_every_token_before_the_page():
    a = keys_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # the partial third page has no key
    b = keys_of([1, 2, 3, 4, 5, 6, 7, 0])
    assert a[0] == b[0] and a[1] != b[1]
    c = keys_of([0, 2, 3, 4, 5, 6, 7, 8])
    assert c[1] != a[1]  # same second page, different first: a different key
    assert keys_of([1, 2, 3, 4], tenant="u") != keys_of([1, 2, 3, 4])
    assert keys_of([1, 2, 3, 4], salt="s") != keys_of([1, 2, 3, 4])
    grown = keys_of([1, 2, 3, 4], pages=1)
    extend_keys(grown, root_key("m", "t", None), [1, 2, 3, 4, 5, 6, 7, 8], PS, 2)
    assert grown == a  # extended page by page: the same chain


def test_scope_fields_cannot_be_shifted_into_each_other():
    assert root_key("m", "ab", "c") != root_key("m", "a", "bc")
    assert root_key("m", "a", None) != root_key("m", "a", "null")


def test_released_keyed_pages_are_evictable_and_evicted_last():
    alloc = PrefixCachingAllocator(4)
    pages = alloc.allocate(2)
    alloc.register(pages[0], b"k0")
    alloc.free(pages)
    assert alloc.num_free == 4 and alloc.num_evictable == 1 and alloc.num_cached == 1
    assert alloc.match([b"k0", b"k1"]) == [pages[0]]
    taken = alloc.allocate(3)  # the free pages go first
    assert pages[0] not in taken and alloc.match([b"k0"]) == [pages[0]]
    last = alloc.allocate(1)  # then the cached one is evicted
    assert last == [pages[0]] and alloc.match([b"k0"]) == [] and alloc.evictions == 1
    with pytest.raises(OutOfPages):
        alloc.allocate(1)


def test_shared_pages_are_counted_and_freed_by_their_last_user():
    alloc = PrefixCachingAllocator(2)
    (page,) = alloc.allocate(1)
    alloc.register(page, b"k")
    alloc.acquire([page])
    assert alloc.refs(page) == 2
    alloc.free([page])
    assert alloc.num_evictable == 0 and alloc.num_free == 1  # still in use by one
    alloc.free([page])
    assert alloc.num_evictable == 1
    alloc.acquire([page])  # an evictable page in use again
    assert alloc.num_evictable == 0 and alloc.refs(page) == 1
    alloc.free([page])
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free([page])


def test_the_first_page_for_a_key_stays_the_cached_one():
    alloc = PrefixCachingAllocator(3)
    a, b = alloc.allocate(2)
    alloc.register(a, b"k")
    alloc.register(b, b"k")  # a duplicate computed beside it
    alloc.free([a, b])
    assert alloc.match([b"k"]) == [a] and alloc.num_evictable == 1
    with pytest.raises(RuntimeError, match="not in use"):
        alloc.register(b, b"other")


def test_refresh_bounds_recomputes_a_pages_key_bounds():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=3, page_size=PS, dtype=torch.float32)
    kv = PagedKVCache(layout, 4, torch.device("cpu"), PrefixCachingAllocator)
    kv.keys.normal_()
    refresh_bounds(kv, [2])
    page = kv.keys[:, :, 2 * PS : 3 * PS]
    assert torch.equal(kv.bounds_min[:, :, 2], page.amin(dim=2))
    assert torch.equal(kv.bounds_max[:, :, 2], page.amax(dim=2))


# -- the scheduler with a prefix cache -----------------------------------------------------------


def make_request(rid, tokens, tenant="t", max_tokens=8, kv=None, **params) -> Request:
    req = Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        params=SamplingParams(max_tokens=max_tokens, kv=kv, **params),
        detokenizer=IncrementalDetokenizer(None, [], ()),
        tenant=tenant,
    )
    req.kv_state = new_state(req.params.kv, PS)
    return req


def caching_scheduler(num_pages=64, **cfg) -> tuple[Scheduler, PrefixCache]:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_size=PS, dtype=torch.float32)
    kv = PagedKVCache(layout, num_pages, torch.device("cpu"), PrefixCachingAllocator)
    s = Scheduler(SchedulingConfig(**cfg), PS, kv.allocator)
    s.prefix = PrefixCache(kv, "m")
    return s, s.prefix


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    for c in out.chunks:
        c.request.num_computed_tokens += c.num_tokens
    for c in out.chunks:
        req = c.request
        if c.samples:
            req.token_ids.append(token)
            if req.num_output_tokens >= req.params.max_tokens:
                req.finish_reason = "length"
                s.finish(req)
    return out


def run(s: Scheduler, prefix: PrefixCache, req: Request):
    prefix.scope(req)
    s.add(req)
    first = None
    while not req.finished:
        out = step(s)
        first = first or next((c for c in out.chunks if c.request is req), None)
    return first


def test_a_shared_prefix_is_mapped_and_only_the_rest_computed():
    s, prefix = caching_scheduler()
    run(s, prefix, make_request("a", range(1, 19), max_tokens=2))  # 18 tokens: 4 full pages
    b = make_request("b", [*range(1, 13), 99, 98, 97])
    first = run(s, prefix, b)
    assert (first.start, first.num_tokens) == (12, 3)  # 3 pages mapped, the rest computed
    assert b.metrics.num_cached_tokens == 12 and prefix.hit["t"] == 12
    assert prefix.queried["t"] == 18 + 15


def test_the_last_prompt_token_is_always_computed():
    s, prefix = caching_scheduler()
    run(s, prefix, make_request("a", range(1, 17), max_tokens=1))
    first = run(s, prefix, make_request("b", range(1, 17), max_tokens=1))
    assert (first.start, first.num_tokens) == (12, 4)  # 4 pages cached, the last recomputed


@pytest.mark.parametrize(
    "other",
    [
        {"tenant": "u"},
        {"cache_salt": "private"},
        {"prompt_logprobs": True},
        {"kv": KVPolicy(kind="window", budget_tokens=8)},
        {"kv": KVPolicy(kind="h2o", budget_tokens=8)},
    ],
)
def test_no_hit_across_scopes_or_for_requests_that_opt_out(other):
    s, prefix = caching_scheduler()
    run(s, prefix, make_request("a", range(1, 19), max_tokens=1))
    first = run(s, prefix, make_request("b", range(1, 19), max_tokens=1, **other))
    assert first.start == 0


def test_evicting_policies_feed_nothing_and_quest_shares():
    s, prefix = caching_scheduler()
    run(s, prefix, make_request("a", range(1, 19), kv=KVPolicy(kind="sinks", budget_tokens=8)))
    assert s.allocator.num_cached == 0
    run(s, prefix, make_request("q", range(1, 19), kv=KVPolicy(kind="quest", budget_tokens=8)))
    first = run(s, prefix, make_request("f", range(1, 19), max_tokens=1))
    assert first.start == 16


def test_a_waiting_request_holds_no_mapped_pages():
    s, prefix = caching_scheduler(num_pages=8, max_num_seqs=1)
    run(s, prefix, make_request("a", range(1, 13), max_tokens=1))
    busy = make_request("busy", [50] * 9, max_tokens=20)
    prefix.scope(busy)
    s.add(busy)
    step(s)
    b = make_request("b", range(1, 13), max_tokens=1)  # no slot: stays waiting
    prefix.scope(b)
    s.add(b)
    step(s)
    assert b.status is RequestStatus.WAITING and b.pages == [] and b.num_computed_tokens == 0
    assert all(s.allocator.refs(p) == 0 for p in s.allocator.match(keys_of(list(range(1, 13)))))


def check_pages(s: Scheduler) -> None:
    """Every page is held by exactly the requests whose tables name it, or free, or evictable."""
    alloc = s.allocator
    held = [0] * alloc.num_pages
    for req in s.running:
        for p in req.pages:
            held[p] += 1
    for req in s.waiting:
        assert not req.pages
    assert [alloc.refs(p) for p in range(alloc.num_pages)] == held
    in_use = sum(1 for h in held if h)
    assert alloc.num_free + in_use == alloc.num_pages
    assert alloc.num_evictable <= alloc.num_cached


def test_soak_random_requests_aborts_and_preemptions_leak_no_page():
    rng = random.Random(0)
    s, prefix = caching_scheduler(num_pages=24, max_num_seqs=6, max_num_batched_tokens=24)
    prompts = [[rng.randrange(1, 5) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    live: list[Request] = []
    for i in range(3000):
        if rng.random() < 0.5:
            base = rng.choice(prompts)
            tokens = [*base[: rng.randrange(1, len(base) + 1)], rng.randrange(1, 5)]
            tenant, salt = rng.choice(["a", "b"]), rng.choice([None, None, "s"])
            req = make_request(f"r{i}", tokens, tenant, rng.randrange(1, 12), cache_salt=salt)
            prefix.scope(req)
            s.add(req)
            live.append(req)
        if live and rng.random() < 0.1:  # an abort, wherever the request is
            victim = live.pop(rng.randrange(len(live)))
            victim.finish_reason = "abort"
            s.finish(victim)
        step(s, token=rng.randrange(1, 5))
        live = [r for r in live if not r.finished]
        check_pages(s)
    while s.has_work():
        step(s)
    check_pages(s)
    alloc = s.allocator
    assert alloc.num_free == alloc.num_pages and alloc.num_evictable == alloc.num_cached
    assert s.num_preemptions > 0 and alloc.evictions > 0 and sum(prefix.hit.values()) > 0


def test_a_burst_with_one_new_prefix_computes_it_once():
    s, prefix = caching_scheduler()
    reqs = [make_request(f"r{i}", [*range(1, 17), 50 + i], max_tokens=2) for i in range(3)]
    for r in reqs:
        prefix.scope(r)
        s.add(r)
    out = step(s)
    assert [(c.request.request_id, c.start) for c in out.chunks] == [("r0", 0)]
    out = step(s)  # r0's pages are cached now: the others map them
    started = {c.request.request_id: c.start for c in out.chunks}
    assert started == {"r0": 17, "r1": 16, "r2": 16} and prefix.waits == 2


def test_a_preempted_producer_is_not_waited_for():
    s, prefix = caching_scheduler()
    a = make_request("a", range(1, 18), max_tokens=2)
    b = make_request("b", range(1, 18), max_tokens=2)
    for r in (a, b):
        prefix.scope(r)
        s.add(r)
    assert [c.request for c in s.schedule().chunks] == [a]  # b waits for a's pages
    assert prefix.map(b) is None
    s._preempt(a, SchedulerOutput())  # before a computed them
    assert prefix.map(b) == 0  # a is queued again: b does not wait for it
