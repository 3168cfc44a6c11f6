"""Prefix-affinity routing: the affinity key of a replica call, the rendezvous ranking with its
load gap, and which pending request gets a replica found (deployments/routing.py)."""

import asyncio
from collections import Counter
from typing import Any

from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest

from deployments.routing import REREAD_S, PrefixAffinityRouter, affinity_key, rank
from services import SamplingParams

SYSTEM = {"role": "system", "content": "You extract invoices. " * 50}
TOOLS = {"tools": [{"type": "function", "function": {"name": "lookup"}}]}


def chat(user: str, tenant: str = "a", salt: str | None = None, system=SYSTEM, template=TOOLS):
    messages = [system, {"role": "user", "content": user}]
    return (None, messages, SamplingParams(cache_salt=salt), tenant, "rid", None, template)


def completion(prompt, tenant: str = "a"):
    return (prompt, None, SamplingParams(), tenant, "rid", None, None)


def test_chats_sharing_system_prompt_and_tools_share_a_key():
    assert affinity_key(chat("one"), 64) == affinity_key(chat("two"), 64)
    other_system = {"role": "system", "content": "You write poems."}
    assert affinity_key(chat("one", system=other_system), 64) != affinity_key(chat("one"), 64)
    assert affinity_key(chat("one", template={"tools": []}), 64) != affinity_key(chat("one"), 64)


def test_the_key_is_scoped_by_tenant_and_salt():
    key = affinity_key(chat("one"), 64)
    assert affinity_key(chat("one", tenant="b"), 64) != key
    assert affinity_key(chat("one", salt="s"), 64) != key


def test_completions_are_keyed_on_their_start():
    a = affinity_key(completion("x" * 64 + "first"), 64)
    assert a == affinity_key(completion("x" * 64 + "second"), 64)
    assert a != affinity_key(completion("y" * 64 + "first"), 64)
    ids = affinity_key(completion(list(range(100))), 64)
    assert ids == affinity_key(completion([*range(16), 7, 7]), 64)  # 64 chars: 16 ids
    assert affinity_key(("not", "a call"), 64) is None


def test_requests_on_an_adapter_are_keyed_by_the_adapter():
    from deployments.adapter_api import AdapterRef

    def on(ref, user, system=SYSTEM):
        return (*chat(user, system=system), None, ref)

    mine = AdapterRef("tenant/a/support", "support")
    key = affinity_key(on(mine, "one"), 64)
    other_system = {"role": "system", "content": "You write poems."}
    assert key == affinity_key(on(mine, "two", other_system), 64)  # where its slot is
    assert key != affinity_key(on(AdapterRef("tenant/b/support", "support"), "one"), 64)
    assert key != affinity_key(on(None, "one"), 64) == affinity_key(chat("one"), 64)


REPLICAS = ["r1", "r2", "r3", "r4"]


def test_rank_is_the_same_everywhere_and_spreads_keys():
    keys = [bytes([i, j]) for i in range(20) for j in range(20)]
    firsts = Counter(rank(k, REPLICAS, {}, 8)[0] for k in keys)
    assert set(firsts) == set(REPLICAS) and min(firsts.values()) > len(keys) / 8
    for k in keys[:20]:  # another router, replicas listed in another order: the same choice
        assert rank(k, REPLICAS, {}, 8) == rank(k, REPLICAS[::-1], {}, 8)


def test_a_busy_preferred_replica_yields_to_the_next_in_its_order():
    key = b"hot prefix"
    order = rank(key, REPLICAS, {}, 8)
    loads = dict.fromkeys(REPLICAS, 2)
    assert rank(key, REPLICAS, loads, 8) == order  # balanced: affinity wins
    loads[order[0]] = 11  # 9 over the least loaded
    assert rank(key, REPLICAS, loads, 8) == [*order[1:], order[0]]
    loads[order[0]] = 10  # within the gap
    assert rank(key, REPLICAS, loads, 8)[0] == order[0]


def test_removing_a_replica_moves_only_the_keys_it_won():
    keys = [bytes([i, j]) for i in range(20) for j in range(20)]
    before = {k: rank(k, REPLICAS, {}, 8)[0] for k in keys}
    after = {k: rank(k, REPLICAS[:3], {}, 8)[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "r4")


# -- fulfilment: which pending request gets the replica a routing attempt found ---------------


class FakeReplica:
    """What Ray's routing loop reads of a replica; always answers an empty queue, and counts
    the probes."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 64
        self.node_id, self.availability_zone = "", None
        self.multiplexed_model_ids: set[str] = set()
        self.probes = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        return 0


DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="test")


def router_with(names: list[str]) -> tuple[PrefixAffinityRouter, dict[str, Any]]:
    """Needs a running event loop (Ray's router makes its tasks on it)."""
    router = PrefixAffinityRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.REPLICA,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(prefix_chars=64, max_load_gap=8)
    replicas: dict[str, Any] = {n: FakeReplica(n) for n in names}  # stand in for RunningReplica
    router.update_replicas(list(replicas.values()))
    return router, replicas


def pending(args: tuple, internal_id: str) -> PendingRequest:
    metadata = RequestMetadata(request_id=internal_id, internal_request_id=internal_id)
    return PendingRequest(args=list(args), kwargs={}, metadata=metadata)


def enqueue(router: PrefixAffinityRouter, *requests: PendingRequest) -> None:
    """As Ray's `_choose_replica_for_request` queues a request, without its routing task."""
    for pr in requests:
        router._pending_requests_to_fulfill.append(pr)
        router._add_pending_request_to_indices(pr)


def test_a_replica_goes_to_the_request_it_was_found_for_not_the_oldest():
    async def scenario() -> None:
        router, replicas = router_with(["r1", "r2"])
        old, new = pending(chat("one"), "id-old"), pending(chat("two"), "id-new")
        enqueue(router, old, new)
        router._fulfill_next_pending_request(replicas["r2"], new.metadata)
        assert new.future.result() is replicas["r2"] and not old.future.done()

    asyncio.run(scenario())


def test_calls_sharing_an_internal_id_each_get_their_own_replica():
    async def scenario() -> None:  # the ingress's n choices: one HTTP request, one internal id
        router, replicas = router_with(["r1", "r2"])
        first, second = pending(chat("one"), "shared"), pending(chat("one"), "shared")
        enqueue(router, first, second)
        router._fulfill_next_pending_request(replicas["r1"], second.metadata)
        assert second.future.result() is replicas["r1"] and not first.future.done()
        router._fulfill_next_pending_request(replicas["r2"], first.metadata)
        assert first.future.result() is replicas["r2"]

    asyncio.run(scenario())


def test_a_replica_found_for_a_request_gone_goes_to_the_oldest_still_waiting():
    async def scenario() -> None:
        router, replicas = router_with(["r1", "r2"])
        gone, old, new = (pending(chat(u), f"id-{u}") for u in ("gone", "old", "new"))
        enqueue(router, gone, old, new)
        gone.future.cancel()  # its client left while the replica was being probed
        router._fulfill_next_pending_request(replicas["r1"], gone.metadata)
        assert old.future.result() is replicas["r1"] and not new.future.done()

    asyncio.run(scenario())


def test_concurrent_requests_all_get_their_ranked_replica():
    """Ray's whole routing loop: 4 prefixes, each sent as 3 calls sharing an internal id and
    4 single calls, all at once; every call gets a replica, the first in its key's order
    (FIFO fulfilment breaks the order; id-matched fulfilment leaves the shared-id calls waiting
    forever)."""

    async def scenario() -> None:
        router, replicas = router_with(["r1", "r2", "r3"])
        calls = [
            pending(chat("u", system={"role": "system", "content": f"app {a}"}), f"req-{a}")
            for a in range(4)
            for _ in range(3)
        ]
        calls += [pending(chat("u", tenant=f"t{i}"), f"single-{i}") for i in range(4)]
        got = await asyncio.wait_for(
            asyncio.gather(*(router._choose_replica_for_request(pr) for pr in calls)), 10
        )
        assert len({replica.replica_id for replica in got}) > 1  # the order is not trivial
        for pr, replica in zip(calls, got, strict=True):
            key = affinity_key(pr.args, 64)
            assert key is not None
            assert replica.replica_id.unique_id == rank(key, list(replicas), {}, 8)[0]

    asyncio.run(scenario())


def test_a_replica_demoted_on_a_stale_load_is_reread_at_most_every_reread_s():
    """A router that saw its prefix's replica busy (another router's burst) and stops sending to
    it hears no more of its load: the demotion re-reads it, so the prefix comes back."""

    async def scenario() -> None:
        router, replicas = router_with(["r1", "r2"])
        await asyncio.sleep(0.01)  # the probe of new replicas: both idle
        args = chat("one")
        home = replicas[rank(affinity_key(args, 64) or b"", list(replicas), {}, 8)[0]]
        cache = router.replica_queue_len_cache

        async def first_choice() -> Any:
            ranks = await router.choose_replicas(list(replicas.values()), pending(args, "id"))
            await asyncio.sleep(0.01)  # the re-read, if any, answers
            return ranks[0][0]

        cache.update(home.replica_id, 32)
        probes = home.probes
        assert await first_choice() is not home and home.probes == probes + 1
        assert cache.get(home.replica_id) == 0 and await first_choice() is home
        cache.update(home.replica_id, 32)  # busy again within REREAD_S: not probed again
        assert await first_choice() is not home and home.probes == probes + 1
        router.reread_at = {rid: t - REREAD_S for rid, t in router.reread_at.items()}
        assert await first_choice() is not home and await first_choice() is home

    asyncio.run(scenario())
