"""KV policies: which cached keys and values each request's attention reads, and which it keeps.

A request's `KVPolicy` (`kvcache.policy_spec`) picks one small class here by its `kind`; the
registry `POLICIES` is the list of legal kinds everywhere. Each class speaks through three hooks,
none of which the engine loop or the attention function knows by name:
- `plan(...)`, before attention: how this step's rows read the cache (`ReadPlan`: every page, the
  pages Quest's bounds select, or explicitly, collecting the attention weights a policy scores by);
- the attention function fills, after attention, the per-slot scores a plan asks for (H2O
  accumulates every query's weights, SnapKV keeps the pooled votes of the prompt's last queries);
- `score(...)`, after a step: for bounded policies, one number per cached token per layer and KV
  head (higher = keep; `inf` = always keep). `compact` keeps the top `budget` per head with the
  generic top-k selector, moves them to the front of the request's pages and frees the rest, as
  kvpress's presses do on top of one top-k press.

A compacted request holds `cached = computed - evicted` tokens. New tokens keep their true position
(their keys were rotated there), except under `rerotate`, where positions are cache indices and kept
keys are rotated back by the distance they moved (StreamingLLM's positions "within the cache").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from kvcache.hot_set import HotSet
from kvcache.pages import PagedKVCache, pages_needed

if TYPE_CHECKING:
    from kvcache.policy_spec import KVPolicy

Collect = Literal["accumulate", "observe"]
# rotate(keys [..., n, D], delta [n]): keys moved by `delta` positions (RoPE rotations compose)
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ReadPlan:
    """How one request's rows read the cache this step (None in a SeqSlice: every page, SDPA)."""

    quest_pages: int | None = None  # single-token rows read this many pages per KV head
    dense_layers: int = 0  # ... from this layer on; earlier layers read every page
    bounds: bool = False  # keep the per-page key min/max of this request's pages current
    scores: bool = False  # the request's new slots start with a zero score
    collect: Collect | None = None  # explicit attention, weights summed into the slot scores
    observe: int = 0  # "observe": only the last `observe` queries vote (pooled, overwritten)
    kernel_size: int = 1
    tier: HotSet | None = None  # offloaded: its page table names parked pages (host tier)
    quest_union: bool = False  # each query head ranks the pages (KVPolicy.quest_heads)


@dataclass
class KVState:
    """One request's policy and how far its cache has been compacted."""

    policy: KVPolicy
    impl: Policy
    evicted: int = 0  # tokens dropped; cache index = logical index - evicted (before rerotate)
    compactions: int = 0
    tier: HotSet | None = None  # offload: the device cells of the parked pages it reads

    def cached(self, computed: int) -> int:
        return computed - self.evicted

    def chunk_limit(self, computed: int, prompt_len: int, page_size: int) -> int | None:
        return self.impl.chunk_limit(self, computed, prompt_len, page_size)

    def position(self, logical: int) -> int:
        """The RoPE position of logical token `logical` (cache index `logical - evicted`)."""
        return logical - self.evicted if self.policy.rerotate else logical


def topk_keep(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`[..., L]` scores -> `[..., k]` indices of the k highest, ascending (order kept in cache)."""
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


class Policy:
    """`full`: every page, nothing evicted. The base class every policy refines."""

    kind: ClassVar[str] = "full"
    bounded: ClassVar[bool] = False
    # The prefix cache (`kvcache.prefix`) may map pages other requests computed, and keep this
    # request's full pages for others: True for policies that never rewrite a page once full.
    # The bounded ones move kept tokens to the front of their pages when they compact (and H2O
    # needs every prompt query's weights, which a cached prefix never computes): they opt out.
    shares_pages: ClassVar[bool] = True
    keeps_bounds: ClassVar[bool] = False  # per-page key bounds (Quest) of every page it holds

    def plan(self, state: KVState, start: int, num_tokens: int, prompt_len: int) -> ReadPlan | None:
        """`start` is the logical index of the row's first new token."""
        return None

    def should_compact(
        self, state: KVState, computed: int, prompt_len: int, page_size: int
    ) -> bool:
        return False

    def chunk_limit(
        self, state: KVState, computed: int, prompt_len: int, page_size: int
    ) -> int | None:
        """The most new tokens the next step may add (None: no limit beyond the scheduler's)."""
        return None

    def score(
        self, state: KVState, kv: PagedKVCache, slots: torch.Tensor, computed: int, prompt_len: int
    ) -> torch.Tensor:
        """`[layers, KVH, cached]` or `[cached]` (the same for every head): higher is kept."""
        raise NotImplementedError


class _Bounded(Policy):
    bounded = True
    shares_pages = False

    def should_compact(
        self, state: KVState, computed: int, prompt_len: int, page_size: int
    ) -> bool:
        # one page of slack: compacting every step would move the whole budget every step
        return state.cached(computed) >= state.policy.budget + page_size

    def chunk_limit(
        self, state: KVState, computed: int, prompt_len: int, page_size: int
    ) -> int | None:
        # prompt chunks stop at budget + one page, so the cache never holds more than that
        return max(page_size, state.policy.budget + page_size - state.cached(computed))


class Window(_Bounded):
    """The most recent `budget` tokens."""

    kind = "window"

    def score(
        self, state: KVState, kv: PagedKVCache, slots: torch.Tensor, computed: int, prompt_len: int
    ) -> torch.Tensor:
        return torch.arange(slots.numel(), dtype=torch.float32, device=kv.device)


class Sinks(Window):
    """StreamingLLM: the first `n_sink` tokens (attention sinks) plus the most recent ones."""

    kind = "sinks"

    def score(
        self, state: KVState, kv: PagedKVCache, slots: torch.Tensor, computed: int, prompt_len: int
    ) -> torch.Tensor:
        recency = super().score(state, kv, slots, computed, prompt_len)
        # the sinks are the first cache entries: compaction keeps order, so they stay in front
        recency[: state.policy.n_sink] = math.inf
        return recency


class H2O(_Bounded):
    """Heavy hitters by attention accumulated over every query so far, plus a recent window."""

    kind = "h2o"

    def plan(self, state: KVState, start: int, num_tokens: int, prompt_len: int) -> ReadPlan:
        return ReadPlan(scores=True, collect="accumulate")

    def score(
        self, state: KVState, kv: PagedKVCache, slots: torch.Tensor, computed: int, prompt_len: int
    ) -> torch.Tensor:
        budget = state.policy.budget
        recent = budget - round(budget * state.policy.heavy_ratio)
        scores = kv.scores[:, :, slots].clone()  # [layers, KVH, cached]
        if recent:
            scores[:, :, -recent:] = math.inf
        return scores


class SnapKV(_Bounded):
    """After prefill: the prompt positions the last `window` queries attend to most, per head.

    Generated tokens get no votes: when the cache overflows during decode, the oldest generated
    tokens outside the last `window` go first, the compressed prompt stays.
    """

    kind = "snapkv"

    def plan(self, state: KVState, start: int, num_tokens: int, prompt_len: int) -> ReadPlan:
        policy = state.policy
        if start < prompt_len <= start + num_tokens:  # this chunk ends the prompt: it votes
            return ReadPlan(
                scores=True,
                collect="observe",
                observe=policy.observe_window,
                kernel_size=policy.kernel_size,
            )
        return ReadPlan(scores=True)

    def should_compact(
        self, state: KVState, computed: int, prompt_len: int, page_size: int
    ) -> bool:
        if computed < prompt_len:
            return False  # votes come from the end of the prompt
        cached = state.cached(computed)
        if state.compactions == 0:
            return cached > state.policy.budget
        return super().should_compact(state, computed, prompt_len, page_size)

    def chunk_limit(
        self, state: KVState, computed: int, prompt_len: int, page_size: int
    ) -> int | None:
        if computed < prompt_len:
            # the whole prompt is cached until its last queries have voted; the chunk that
            # votes ends with the prompt (after a preemption the outputs follow it)
            return prompt_len - computed
        return super().chunk_limit(state, computed, prompt_len, page_size)

    def score(
        self, state: KVState, kv: PagedKVCache, slots: torch.Tensor, computed: int, prompt_len: int
    ) -> torch.Tensor:
        scores = kv.scores[:, :, slots].clone()
        scores[:, :, -state.policy.observe_window :] = math.inf
        return scores


class Quest(Policy):
    """Every page kept; each decode step reads the pages whose key bounds score highest.

    Per page and KV head the cache keeps the channel-wise min and max of its post-RoPE keys; a
    query q bounds any key's logit in the page by sum_d max(q_d * max_d, q_d * min_d). GQA: the
    query heads sharing a KV head combine by taking the largest bound (a page any of them may
    attend to strongly is read), so each KV head reads exactly `budget // page_size` pages.
    """

    kind = "quest"
    keeps_bounds = True

    def plan(self, state: KVState, start: int, num_tokens: int, prompt_len: int) -> ReadPlan:
        policy = state.policy
        decode = num_tokens == 1 and start >= prompt_len  # prefill and multi-token rows: dense
        return ReadPlan(
            quest_pages=max(1, policy.budget // (policy.page_size or 1)) if decode else None,
            dense_layers=policy.dense_layers,
            bounds=self.keeps_bounds,
            tier=state.tier,
            quest_union=policy.quest_heads == "union",
        )

    def chunk_limit(
        self, state: KVState, computed: int, prompt_len: int, page_size: int
    ) -> int | None:
        if computed >= prompt_len:
            # output tokens go one per step, each reading the pages it selects: after a
            # preemption the recomputed outputs read what they read the first time
            return 1
        limit = prompt_len - computed  # a prompt chunk never runs into the outputs
        if state.policy.offload:
            # offloaded prompts go in budget-sized chunks, parked behind as they fill: a prompt
            # longer than the device pool still runs
            limit = min(limit, max(page_size, state.policy.budget))
        return limit


# The registry: every legal `KVPolicy.kind` (engine, HTTP body, the tests' table) comes from here.
POLICIES: dict[str, Policy] = {
    p.kind: p for p in (Policy(), Window(), Sinks(), H2O(), SnapKV(), Quest())
}


def new_state(policy: KVPolicy | None, page_size: int) -> KVState | None:
    """The request's state, or None for dense attention over every page (the default)."""
    if policy is None or policy.kind == "full":
        return None
    if policy.page_size is None:  # Quest reads whole pages: record the pool's
        policy = replace(policy, page_size=page_size)
    return KVState(policy, POLICIES[policy.kind])


def compact(
    kv: PagedKVCache,
    state: KVState,
    pages: list[int],
    computed: int,
    prompt_len: int,
    rotate: Rotate | None = None,
) -> list[int]:
    """Keeps the top `budget` tokens per layer and head at the front of `pages`.

    Returns the pages no longer needed (the caller frees them).
    """
    ps = kv.page_size
    cached = state.cached(computed)
    budget = state.policy.budget
    idx = torch.arange(cached, device=kv.device)
    page_t = torch.tensor(pages, device=kv.device)
    slots = page_t[idx // ps] * ps + idx % ps  # [cached] slot of each cache index
    scores = state.impl.score(state, kv, slots, computed, prompt_len)
    keep = topk_keep(scores, budget)  # [budget] or [layers, KVH, budget]
    dst = slots[:budget]
    if keep.dim() == 1:
        kept_k = kv.keys[:, :, slots[keep]]
        kept_v = kv.values[:, :, slots[keep]]
        if rotate is not None and state.policy.rerotate:
            delta = torch.arange(budget, device=kv.device) - keep  # <= 0: moved towards the front
            kept_k = rotate(kept_k, delta)
        if kv.scores.numel():
            kv.scores[:, :, dst] = kv.scores[:, :, slots[keep]]
    else:
        per_head = slots[keep]  # [layers, KVH, budget] source slots
        kept_k = kv.keys.gather(2, per_head[..., None].expand(-1, -1, -1, kv.keys.shape[-1]))
        kept_v = kv.values.gather(2, per_head[..., None].expand(-1, -1, -1, kv.keys.shape[-1]))
        kv.scores[:, :, dst] = kv.scores.gather(2, per_head)
    kv.keys[:, :, dst] = kept_k
    kv.values[:, :, dst] = kept_v
    state.evicted += cached - budget
    state.compactions += 1
    keep_pages = pages_needed(budget, ps)
    return pages[keep_pages:]
