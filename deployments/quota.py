"""Tenant limits for the whole service, not per ingress replica: requests per minute, concurrent
requests and tokens per minute.

In Redis one script per step keeps each step atomic across replicas:
- rate: a token bucket of `requests_per_minute` (a burst of a minute's worth, refilled evenly);
- concurrency: a sorted set of leases scored by their expiry. A lease lives `LEASE_S` unless its
  replica renews it, so slots held by a replica that died come back on their own;
- tokens: a bucket of `tokens_per_minute` charged with each answer's prompt and completion tokens
  when it ends (they are not known before); a tenant in debt waits until the refill repays it.

While Redis is unreachable each replica counts alone, with every limit divided by the number of
ingress replicas: the tenant never gets more than its share in total, only less when its traffic
is uneven. Times come from the caller's clock (wall time between replicas, a fake one in tests).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.service_config import TenantLimits

log = logging.getLogger(__name__)

LEASE_S = 30.0  # a concurrency slot outlives a dead replica by at most this
DOWN_S = 5.0  # after a Redis failure the local count is used this long before trying again
_PREFIX = "structserve:quota"

_ADMIT = """
local now, rpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tpm, slots, lease, expiry = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local mode, start = ARGV[8], tonumber(ARGV[9])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if slots > 0 and redis.call('ZCARD', KEYS[2]) + slots > conc then return {'concurrency', '1'} end
if mode ~= 'slots' and tpm > 0 then
  local t = redis.call('HMGET', KEYS[3], 'level', 'at')
  local level = math.min(tpm, (tonumber(t[1]) or tpm) + (now - (tonumber(t[2]) or now)) * tpm / 60)
  if level <= 0 then return {'tokens', tostring((1 - level) * 60 / tpm)} end
end
if mode == 'all' then
  local r = redis.call('HMGET', KEYS[1], 'level', 'at')
  local level = math.min(rpm, (tonumber(r[1]) or rpm) + (now - (tonumber(r[2]) or now)) * rpm / 60)
  if level < 1 then return {'rate', tostring((1 - level) * 60 / rpm)} end
  redis.call('HSET', KEYS[1], 'level', tostring(level - 1), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[1], 120)
end
for i = 1, slots do redis.call('ZADD', KEYS[2], expiry, lease .. '#' .. (start + i)) end
redis.call('EXPIRE', KEYS[2], 600)
return {'ok', '0'}
"""

_CHARGE = """
local now, tpm, used = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = math.min(tpm, (tonumber(t[1]) or tpm) + (now - (tonumber(t[2]) or now)) * tpm / 60)
redis.call('HSET', KEYS[1], 'level', tostring(level - used), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], 600)
return 1
"""


class LimitError(Exception):
    """A 429 the client can act on: `retry_after` seconds, `reason` rate, concurrency or tokens."""

    def __init__(self, message: str, retry_after: float, reason: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


def _refusal(reason: str, wait: float, lim: TenantLimits) -> LimitError:
    wait = max(1.0, math.ceil(wait))  # Retry-After is whole seconds
    if reason == "concurrency":
        return LimitError(f"the tenant has {lim.max_concurrent} requests running", wait, reason)
    if reason == "tokens":
        return LimitError(f"over {lim.tokens_per_minute} tokens per minute", wait, reason)
    return LimitError(f"over {lim.requests_per_minute} requests per minute", wait, reason)


@dataclass
class Lease:
    """One request's hold on its tenant's limits. `release` is idempotent: every exit path may
    call it, the first one counts."""

    tenant: str
    lease_id: str
    slots: int
    local: bool  # admitted on the local count (Redis was down): released there too
    released: bool = False
    tokens_only: bool = False  # a batch line's: no slots, no rate token (Quota.admit_tokens)


@dataclass
class _Bucket:
    level: float
    at: float

    def refill(self, capacity: float, now: float) -> float:
        self.level = min(capacity, self.level + (now - self.at) * capacity / 60.0)
        self.at = now
        return self.level


@dataclass
class _Local:
    """One tenant's counts in this replica alone."""

    rate: _Bucket
    tokens: _Bucket
    active: int = 0
    leases: dict[str, int] = field(default_factory=dict)


class Quota:
    def __init__(
        self,
        redis: Any | None,
        replicas: int = 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.replicas = max(1, replicas)
        self.clock = clock
        self._lock = threading.Lock()
        self._local: dict[str, _Local] = {}
        self._held: dict[str, Lease] = {}  # this replica's Redis leases, renewed while held
        self._down_until = 0.0
        self._scripts: dict[str, Any] = {}
        # (key, members) of releases Redis did not take (it hung or was down): taken off when it
        # answers again, so a stream that ended meanwhile does not hold its slot to expiry
        self._unreleased: list[tuple[str, list[str]]] = []

    # -- the three steps -------------------------------------------------------------------

    def admit(self, tenant: str, lim: TenantLimits, slots: int = 1) -> Lease:
        """Takes a rate token and `slots` concurrency slots, or raises `LimitError`."""
        lease = Lease(tenant, secrets.token_hex(8), 0, local=False)
        self._take(lease, lim, slots, "all")
        return lease

    def admit_tokens(self, tenant: str, lim: TenantLimits) -> Lease:
        """A lease that only charges tokens (a batch line: the runner bounds how many run, the
        batch is not requests per minute), or `LimitError` while the tenant's tokens are spent."""
        lease = Lease(tenant, secrets.token_hex(8), 0, local=False, tokens_only=True)
        self._take(lease, lim, 0, "tokens")
        return lease

    def grow(self, lease: Lease, lim: TenantLimits, slots: int) -> None:
        """`slots` more concurrency slots for the same request (its `n` once the body is read)."""
        if slots > 0 and not lease.tokens_only:
            self._take(lease, lim, slots, "slots")

    def release(self, lease: Lease, lim: TenantLimits, tokens: int = 0) -> None:
        """Frees the lease's slots and charges the tokens its answer used."""
        with self._lock:
            if lease.released:
                return
            lease.released = True
            self._held.pop(lease.lease_id, None)
        if lease.local:
            self._release_local(lease, lim, tokens)
            return
        members = [f"{lease.lease_id}#{i + 1}" for i in range(lease.slots)]
        key = self._key(lease.tenant, "active")
        if not self._redis_up():
            self._later(key, members)
            return
        try:
            pipe = self.redis.pipeline()  # type: ignore[union-attr]
            if members:
                pipe.zrem(key, *members)
            if tokens and lim.tokens_per_minute:
                args = (self.clock(), lim.tokens_per_minute, tokens)
                pipe.evalsha(self._sha("charge"), 1, self._key(lease.tenant, "tokens"), *args)
            pipe.execute()
        except Exception as exc:  # the slots go when Redis answers again; the tokens are forgiven
            self._failed(exc)
            self._later(key, members)

    def _later(self, key: str, members: list[str]) -> None:
        if members:
            with self._lock:
                self._unreleased.append((key, members))

    def _flush_unreleased(self) -> None:
        """Releases Redis missed, now that it may answer (before each admission and renewal)."""
        with self._lock:
            pending, self._unreleased = self._unreleased, []
        if not pending:
            return
        try:
            pipe = self.redis.pipeline()  # type: ignore[union-attr]
            for key, members in pending:
                pipe.zrem(key, *members)
            pipe.execute()
        except Exception as exc:  # still away: kept for the next try
            self._failed(exc)
            with self._lock:
                self._unreleased = pending + self._unreleased

    def renew(self) -> None:
        """Pushes back the expiry of every lease this replica holds (call every few seconds)."""
        if self._redis_up():
            self._flush_unreleased()
        with self._lock:
            held = [x for x in self._held.values() if not x.released]
        if not held or not self._redis_up():
            return
        expiry = self.clock() + LEASE_S
        try:
            pipe = self.redis.pipeline()  # type: ignore[union-attr]
            for lease in held:
                members = {f"{lease.lease_id}#{i + 1}": expiry for i in range(lease.slots)}
                pipe.zadd(self._key(lease.tenant, "active"), members, xx=True)
                pipe.expire(self._key(lease.tenant, "active"), 600)
            pipe.execute()
        except Exception as exc:
            self._failed(exc)

    # -- Redis ------------------------------------------------------------------------------

    def _take(self, lease: Lease, lim: TenantLimits, slots: int, mode: str) -> None:
        """`mode`: "all" (slots, a rate token, tokens left), "slots" (more slots for an admitted
        request), "tokens" (tokens left only)."""
        if lease.local or (not lease.slots and not self._redis_up()):
            self._take_local(lease, lim, slots, mode)
            return
        if not self._redis_up():  # half admitted on Redis: its slots cannot be counted locally
            raise LimitError("limits are unavailable; try again", 1.0, "concurrency")
        self._flush_unreleased()
        now = self.clock()
        # members are <lease>#1..#slots; a grown lease's new ones continue the numbering
        args = (
            *(now, lim.requests_per_minute, lim.max_concurrent, lim.tokens_per_minute or 0),
            *(slots, lease.lease_id, now + LEASE_S, mode, lease.slots),
        )
        keys = [self._key(lease.tenant, k) for k in ("rate", "active", "tokens")]
        try:
            out = self.redis.evalsha(self._sha("admit"), 3, *keys, *args)  # type: ignore[union-attr]
        except Exception as exc:
            self._failed(exc)
            if lease.slots:  # half admitted on Redis: its slots there expire with the lease
                raise LimitError("limits are unavailable; try again", 1.0, "concurrency") from exc
            self._take_local(lease, lim, slots, mode)
            return
        reason, wait = (x.decode() if isinstance(x, bytes) else str(x) for x in out)
        if reason != "ok":
            raise _refusal(reason, float(wait), lim)
        with self._lock:
            late = lease.released  # released while these slots were being taken
            if not late:
                lease.slots += slots
                if lease.slots:  # renewed while held (a tokens-only lease holds nothing)
                    self._held[lease.lease_id] = lease
        if late:
            first = lease.slots + 1
            members = [f"{lease.lease_id}#{i}" for i in range(first, first + slots)]
            try:
                self.redis.zrem(self._key(lease.tenant, "active"), *members)  # type: ignore[union-attr]
            except Exception as exc:  # they expire with the lease
                self._failed(exc)

    def _sha(self, name: str) -> str:
        sha = self._scripts.get(name)
        if sha is None:
            body = _ADMIT if name == "admit" else _CHARGE
            sha = self._scripts[name] = self.redis.script_load(body)  # type: ignore[union-attr]
        return sha

    @staticmethod
    def _key(tenant: str, what: str) -> str:
        return f"{_PREFIX}:{{{tenant}}}:{what}"  # one hash slot per tenant (Redis Cluster)

    def _redis_up(self) -> bool:
        return self.redis is not None and self.clock() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        if self.clock() >= self._down_until:
            log.warning("limits: Redis failed (%s); counting in this replica for now", exc)
        self._down_until = self.clock() + DOWN_S
        self._scripts.clear()  # a restarted Redis has forgotten them

    # -- the local count --------------------------------------------------------------------

    def _share(self, value: int) -> int:
        return max(1, value // self.replicas)

    def _take_local(self, lease: Lease, lim: TenantLimits, slots: int, mode: str) -> None:
        now = self.clock()
        rpm, tpm = self._share(lim.requests_per_minute), lim.tokens_per_minute
        tpm = self._share(tpm) if tpm else 0
        with self._lock:
            if lease.released:  # released while waiting for this lock: nothing to take
                return
            t = self._local.get(lease.tenant)
            if t is None:
                t = self._local[lease.tenant] = _Local(_Bucket(rpm, now), _Bucket(tpm, now))
            if slots and t.active + slots > self._share(lim.max_concurrent):
                raise _refusal("concurrency", 1.0, lim)
            if mode != "slots" and tpm and t.tokens.refill(tpm, now) <= 0:
                raise _refusal("tokens", (1 - t.tokens.level) * 60 / tpm, lim)
            if mode == "all":
                if t.rate.refill(rpm, now) < 1:
                    raise _refusal("rate", (1 - t.rate.level) * 60 / rpm, lim)
                t.rate.level -= 1
            t.active += slots
            t.leases[lease.lease_id] = t.leases.get(lease.lease_id, 0) + slots
            lease.slots += slots
            lease.local = True

    def _release_local(self, lease: Lease, lim: TenantLimits, tokens: int) -> None:
        with self._lock:
            t = self._local.get(lease.tenant)
            if t is None:  # admitted on Redis, released while it is down: its slots expire
                return
            t.active -= t.leases.pop(lease.lease_id, 0)
            if tokens and lim.tokens_per_minute:
                tpm = self._share(lim.tokens_per_minute)
                t.tokens.refill(tpm, self.clock())
                t.tokens.level -= tokens
