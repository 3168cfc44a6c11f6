"""Prefix-affinity routing: the affinity key of a replica call, and the rendezvous ranking with
its load gap (deployments/routing.py)."""

from collections import Counter

from deployments.routing import affinity_key, rank
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
