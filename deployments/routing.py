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
first replica whose queue is not full. A router hears of a replica's load only from its own
requests to it and from probes, so one that stops sending to a replica it saw busy would keep
that view for Ray's cache lifetime (10 s) and send the replica's prefixes elsewhere long after
the burst (other routers still send them there): a replica it demotes is re-read in the
background, at most every `REREAD_S`.

Fulfilment: a replica found for a request goes to that request. Ray's default router (FIFO)
hands it to the oldest pending request instead, which under load sends many requests to a
replica ranked for another one and loses most of the affinity's hits. Ray's bare
`RequestRouter` matches on the internal request id, but the calls made while serving one HTTP
request (the ingress's `n` choices) share that id, and all but one of them then never get a
replica. So the match is on the request itself, and FIFO takes over only when that request is
gone (cancelled while its replica was being probed): no replica found is wasted, no request is
left without one.

Requests on a LoRA adapter are keyed by the adapter alone: they go to the replica that keeps it in
a slot (a load is a copy of its weights; their prompts' prefixes are cached there too), and spill
over as a hot prefix does.

Installed only with several LLM replicas (deployments/app.py): with one there is nothing to
choose. Tenant-aware like the cache itself: the key includes the tenant, so two tenants with the
same system prompt need not meet on one replica (their pages are never shared anyway).
Ray Serve LLM's `PrefixCacheAffinityRouter` keeps a prefix tree of every prompt in one actor and
asks it twice per request; rendezvous on the prefix gets the affinity without that round trip.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ray.serve._private.common import RequestMetadata
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

MAX_KEY_CHARS = 1 << 16  # a huge first message is hashed up to here (the key stays the same)
REREAD_S = 1.0  # a replica demoted for its load is probed at most this often, per router


def affinity_key(args: Sequence[Any], prefix_chars: int) -> bytes | None:
    """The key of a call `LLMReplica.generate(prompt, messages, params, tenant, ...)`; None
    when the arguments are not such a call."""
    if len(args) < 4:
        return None
    prompt, messages, params, tenant = args[:4]
    adapter = getattr(args[8], "name", None) if len(args) > 8 else None
    if adapter is not None:  # one replica keeps the adapter resident (while its load allows)
        return hashlib.blake2b(b"adapter\0" + str(adapter).encode(), digest_size=16).digest()
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


def over_gap(replicas: Sequence[str], loads: dict[str, int], max_load_gap: int) -> set[str]:
    """The replicas more than `max_load_gap` requests busier than the least busy one (a replica
    with no known load counts as idle)."""
    if not loads or not replicas:
        return set()
    least = min(loads.get(r, 0) for r in replicas)
    return {r for r in replicas if loads.get(r, 0) - least > max_load_gap}


def rank(
    key: bytes, replicas: Sequence[str], loads: dict[str, int], max_load_gap: int
) -> list[str]:
    """Replica ids in the order a request with `key` should try them: rendezvous order, with
    the replicas over `max_load_gap` above the least loaded moved behind the others."""
    order = sorted(
        replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest()
    )[::-1]
    busy = over_gap(replicas, loads, max_load_gap)
    return [r for r in order if r not in busy] + [r for r in order if r in busy]


def own_request(
    metadata: RequestMetadata | None,
    by_id: dict[str, PendingRequest],
    pending: Iterable[PendingRequest],
) -> PendingRequest | None:
    """The pending request a routing attempt was made for, None when it is done or gone.

    `by_id` (Ray's index by internal request id) holds one request per id, and the calls made
    while serving one request share its id: only the metadata object is the request's own."""
    if metadata is None:
        return None
    found = by_id.get(metadata.internal_request_id)
    if found is None or found.metadata is not metadata:  # a sibling's, or already taken out
        found = next((p for p in pending if p.metadata is metadata), None)
    return found if found is not None and not found.future.done() else None


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Ray's default router (locality, power of two choices) for requests with no affinity key;
    ranked by the key otherwise. A replica found goes to the request it was found for (FIFO
    only when that one is gone), keyed or not."""

    def initialize_state(self, **kwargs: Any) -> None:
        """`RoutingConfig`'s `prefix_chars` and `max_load_gap` (deployments/app.py)."""
        self.prefix_chars = int(kwargs.get("prefix_chars", 2048))
        self.max_load_gap = int(kwargs.get("max_load_gap", 8))
        self.reread_at: dict[str, float] = {}  # replica id -> when its load was last re-read
        self.rereads: set[asyncio.Task] = set()  # held: the loop keeps only weak references

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
        ids = list(by_id)
        self.reread([by_id[rid] for rid in over_gap(ids, loads, self.max_load_gap)], ids)
        return [[by_id[rid]] for rid in rank(key, ids, loads, self.max_load_gap)]

    def reread(self, demoted: list[RunningReplica], live: list[str]) -> None:
        """Probe, in the background, the demoted replicas not re-read in the last `REREAD_S`
        (see the module docstring); Ray's probe updates its queue length cache."""
        now = time.monotonic()
        due = [
            r
            for r in demoted
            if now - self.reread_at.get(r.replica_id.unique_id, -math.inf) >= REREAD_S
        ]
        if not due:
            return
        self.reread_at = {rid: t for rid, t in self.reread_at.items() if rid in live}
        self.reread_at.update((r.replica_id.unique_id, now) for r in due)
        task = self._event_loop.create_task(self._probe_queue_lens(due, 0))
        self.rereads.add(task)
        task.add_done_callback(self.rereads.discard)

    def _get_pending_request_matching_metadata(
        self, request_metadata: RequestMetadata | None = None
    ) -> PendingRequest | None:
        # Ray's FIFO mixin asks this first and gives the replica to the oldest pending request
        # when it answers None (see the module docstring)
        own = own_request(
            request_metadata, self._pending_requests_by_id, self._pending_requests_to_fulfill
        )
        if own is not None:
            return own
        return super()._get_pending_request_matching_metadata(request_metadata)
