"""Tenant limits (deployments/quota.py) on a fake clock: each limit on Redis (a private real
server) and on the local count, shared between two ingress replicas, leases that outlive a dead
replica only briefly, and the fallback while Redis is down."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from deployments.quota import DOWN_S, LEASE_S, LimitError, Quota
from deployments.service_config import TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Switch:
    """A Redis client that fails every call while `down` (a Redis outage, on demand)."""

    def __init__(self, client: Any) -> None:
        self.client, self.down = client, False

    def __getattr__(self, name: str) -> Any:
        if self.down:
            raise redis.ConnectionError("Redis is down (test)")
        attr = getattr(self.client, name)
        if name != "pipeline":
            return attr
        switch = self

        class Pipe:
            def __init__(self) -> None:
                self.pipe = attr()

            def __getattr__(self, op: str) -> Any:
                return getattr(self.pipe, op)

            def execute(self) -> Any:
                if switch.down:
                    raise redis.ConnectionError("Redis is down (test)")
                return self.pipe.execute()

        return Pipe


@pytest.fixture(scope="module")
def redis_url(redis_server: Any) -> str:
    url, _proc = redis_server()
    return url


def builder(client: Any | None) -> Any:
    """build(replicas=1) -> (Quota, Clock, Switch|None); every Quota built shares one Redis
    and one clock."""
    clock = Clock()
    if client is not None:
        client.flushdb()

    def build(replicas: int = 1) -> tuple[Quota, Clock, Switch | None]:
        switch = Switch(client) if client is not None else None
        return Quota(switch, replicas, clock=clock), clock, switch

    return build


@pytest.fixture(params=["redis", "local"])
def make(request: Any, redis_url: str) -> Any:
    return builder(redis.Redis.from_url(redis_url) if request.param == "redis" else None)


@pytest.fixture
def shared(redis_url: str) -> Any:
    return builder(redis.Redis.from_url(redis_url))


def refused(fn: Any, *args: Any) -> LimitError:
    with pytest.raises(LimitError) as err:
        fn(*args)
    return err.value


def test_requests_per_minute_is_a_bucket_refilled_evenly(make: Any) -> None:
    quota, clock, _ = make()
    lim = TenantLimits(requests_per_minute=60, max_concurrent=1000)
    for _ in range(60):  # a minute's worth at once
        quota.admit("a", lim)
    err = refused(quota.admit, "a", lim)
    assert (err.reason, err.retry_after) == ("rate", 1.0)
    quota.admit("b", lim)  # another tenant is untouched
    clock.now += 1.0
    quota.admit("a", lim)
    assert refused(quota.admit, "a", lim).reason == "rate"


def test_concurrency_counts_slots_and_release_is_idempotent(make: Any) -> None:
    quota, _, _ = make()
    lim = TenantLimits(max_concurrent=3)
    first = quota.admit("a", lim)
    quota.grow(first, lim, 1)  # a request with n=2
    second = quota.admit("a", lim)
    err = refused(quota.admit, "a", lim)
    assert (err.reason, err.retry_after) == ("concurrency", 1.0)
    assert refused(quota.grow, second, lim, 1).reason == "concurrency"
    quota.release(first, lim)
    quota.release(first, lim)  # a second release frees nothing more
    third = quota.admit("a", lim)
    quota.grow(third, lim, 1)  # had the double release freed 4 slots, a 4th would fit now
    assert refused(quota.admit, "a", lim).reason == "concurrency"  # 1 + 2 of 3 held
    quota.release(second, lim)
    quota.release(third, lim)
    quota.grow(quota.admit("a", lim), lim, 2)  # all three free again


def test_slots_taken_after_the_release_are_given_back(make: Any) -> None:
    """A grow that lands after its request was released (the client left meanwhile)."""
    quota, _, _ = make()
    lim = TenantLimits(max_concurrent=2)
    lease = quota.admit("a", lim)
    quota.release(lease, lim)
    quota.grow(lease, lim, 1)
    quota.grow(quota.admit("a", lim), lim, 1)  # both slots are free


def test_tokens_per_minute_charge_after_the_answer_and_debt_waits(make: Any) -> None:
    quota, clock, _ = make()
    lim = TenantLimits(tokens_per_minute=600)
    lease = quota.admit("a", lim)
    quota.release(lease, lim, tokens=700)  # 100 over: refill at 10 tokens a second
    err = refused(quota.admit, "a", lim)
    assert err.reason == "tokens" and err.retry_after == 11.0  # (100 + 1) / 10, whole seconds
    clock.now += 10.0
    assert refused(quota.admit, "a", lim).reason == "tokens"  # level 0: still not positive
    clock.now += 1.0
    quota.admit("a", lim)
    quota.admit("b", lim)


def test_a_batch_lines_lease_takes_no_slot_or_rate_token_but_charges_tokens(make: Any) -> None:
    quota, clock, _ = make()
    lim = TenantLimits(requests_per_minute=2, max_concurrent=1, tokens_per_minute=600)
    lines = [quota.admit_tokens("a", lim) for _ in range(5)]  # more than both limits allow
    quota.grow(lines[0], lim, 3)  # its choices: no slots either
    interactive = quota.admit("a", lim)  # the tenant's own requests are not turned away
    quota.release(interactive, lim)
    quota.renew()  # nothing to renew for a line's lease, and no error
    for lease in lines:
        quota.release(lease, lim, tokens=140)  # 700: 100 over
    assert refused(quota.admit_tokens, "a", lim).reason == "tokens"  # its tokens are spent
    assert refused(quota.admit, "a", lim).reason == "tokens"  # for both kinds
    clock.now += 11.0
    quota.admit_tokens("a", lim)


def test_limits_hold_for_the_service_across_two_replicas(shared: Any) -> None:
    one, clock, _ = shared(replicas=2)
    two, _, _ = shared(replicas=2)
    lim = TenantLimits(requests_per_minute=10, max_concurrent=4)
    held = [one.admit("a", lim), two.admit("a", lim), one.admit("a", lim), two.admit("a", lim)]
    assert refused(one.admit, "a", lim).reason == "concurrency"
    assert refused(two.admit, "a", lim).reason == "concurrency"
    for lease in held:
        (one if held.index(lease) % 2 == 0 else two).release(lease, lim)
    for i in range(6):  # 4 of the 10 requests are spent: 6 more in all, wherever they land
        (one, two)[i % 2].release((one, two)[i % 2].admit("a", lim), lim)
    assert refused(two.admit, "a", lim).reason == "rate"
    assert refused(one.admit, "a", lim).reason == "rate"
    clock.now += 6.0  # one more request a replica can take
    one.release(one.admit("a", lim), lim)


def test_a_dead_replicas_slots_come_back_after_the_lease(shared: Any) -> None:
    live, clock, _ = shared()
    dead, _, _ = shared()
    lim = TenantLimits(max_concurrent=2)
    dead.admit("a", lim)  # its replica dies: never released, never renewed
    kept = live.admit("a", lim)
    assert refused(live.admit, "a", lim).reason == "concurrency"
    clock.now += LEASE_S * 0.6
    live.renew()  # the live replica keeps its own lease
    clock.now += LEASE_S * 0.6
    fresh = live.admit("a", lim)  # the dead one's slot expired; the renewed one holds
    assert refused(live.admit, "a", lim).reason == "concurrency"
    live.release(kept, lim)
    live.release(fresh, lim)


def test_redis_down_keeps_serving_on_a_smaller_local_share(shared: Any) -> None:
    quota, clock, switch = shared(replicas=2)
    lim = TenantLimits(requests_per_minute=100, max_concurrent=4)
    on_redis = quota.admit("a", lim)
    switch.down = True
    local = [quota.admit("a", lim), quota.admit("a", lim)]  # 4 / 2 replicas locally
    assert refused(quota.admit, "a", lim).reason == "concurrency"
    assert refused(quota.grow, on_redis, lim, 1).reason == "concurrency"  # half on Redis
    quota.release(on_redis, lim)  # not counted locally; given back to Redis once it is up
    quota.release(local[0], lim)
    quota.admit("a", lim)
    switch.down = False  # still local until DOWN_S has passed (no retry storm on Redis)
    assert refused(quota.admit, "a", lim).reason == "concurrency"
    clock.now += DOWN_S
    for _ in range(4):  # on Redis again: its own count, the first lease's slot given back
        quota.admit("a", lim)
    assert refused(quota.admit, "a", lim).reason == "concurrency"
