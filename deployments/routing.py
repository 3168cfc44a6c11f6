"""Prefix-affinity routing to the LLM replicas: requests that start the same way go to the replica
whose prefix cache holds that start, while the load stays balanced.

A Ray Serve request router (`RequestRouterConfig`, the `RequestRouter` base class), run by every
handle that calls the LLM replicas (each ingress replica has its own). Each request gets an
affinity key, a hash of its tenant, its `cache_salt` and the start of its input (for chat: the
tools and the first message, the system prompt agents resend with every turn; for completions:
the first `prefix_chars` characters). The replicas are ranked by rendezvous hashing on that key
(highest `hash(key, replica)` first), so every router, with no state shared and none kept, sends
a given prefix to the same replica, and different prefixes spread evenly; a replica joining or
leaving moves only the prefixes it wins or held.

Balance: a replica more than `max_load_gap` requests busier than the least busy one (Ray's queue
length cache: requests in flight to it) loses its rank to the next replica in the same order, so a
hot prefix spills over to one second replica, not to all of them. Ray picks, rank by rank, the
first replica whose queue is not full.

Installed only with several LLM replicas (deployments/app.py): with one there is nothing to
choose. Tenant-aware like the cache itself: the key includes the tenant, so two tenants with the
same system prompt need not meet on one replica (their pages are never shared anyway).
Ray Serve LLM's `PrefixCacheAffinityRouter` keeps a prefix tree of every prompt in one actor and
asks it twice per request; rendezvous on the prefix gets the affinity without that round trip.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

MAX_KEY_CHARS = 1 << 16  # a huge first message is hashed up to here (the key stays the same)


def affinity_key(args: Sequence[Any], prefix_chars: int) -> bytes | None:
    """The key of a call `LLMReplica.generate(prompt, messages, params, tenant, ...)`; None
    when the arguments are not such a call."""
    if len(args) < 4:
        return None
    prompt, messages, params, tenant = args[:4]
    template = args[6] if len(args) > 6 and isinstance(args[6], dict) else {}
    if messages:
        first = messages[0] if isinstance(messages[0], dict) else {}
        start = json.dumps([template.get("tools"), first.get("role"), first.get("content")])
    elif isinstance(prompt, str):
        start = prompt[:prefix_chars]
    elif isinstance(prompt, list):  # token ids: about four characters each
        start = json.dumps(prompt[: max(1, prefix_chars // 4)])
    else:
        return None
    scope = json.dumps([str(tenant), getattr(params, "cache_salt", None)])
    h = hashlib.blake2b(scope.encode(), digest_size=16)
    h.update(start[:MAX_KEY_CHARS].encode("utf-8", "replace"))
    return h.digest()


def rank(
    key: bytes, replicas: Sequence[str], loads: dict[str, int], max_load_gap: int
) -> list[str]:
    """Replica ids in the order a request with `key` should try them: rendezvous order, with
    the replicas over `max_load_gap` above the least loaded moved behind the others."""
    order = sorted(
        replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest()
    )[::-1]
    if not loads:
        return order
    least = min(loads.get(r, 0) for r in replicas)
    near = [r for r in order if loads.get(r, 0) - least <= max_load_gap]
    return near + [r for r in order if r not in near]


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Ray's default router (FIFO fulfilment, locality, power of two choices) for requests with
    no affinity key; ranked by the key otherwise."""

    def initialize_state(self, **kwargs: Any) -> None:
        """`RoutingConfig`'s `prefix_chars` and `max_load_gap` (deployments/app.py)."""
        self.prefix_chars = int(kwargs.get("prefix_chars", 2048))
        self.max_load_gap = int(kwargs.get("max_load_gap", 8))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = None
        if pending_request is not None and pending_request.args:
            key = affinity_key(pending_request.args, self.prefix_chars)
        if key is None or len(candidate_replicas) < 2:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {}
        for rid, replica in by_id.items():
            length = cache.get(replica.replica_id)
            if length is not None:
                loads[rid] = length
        return [[by_id[rid]] for rid in rank(key, list(by_id), loads, self.max_load_gap)]
