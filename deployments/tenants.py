"""Tenants at the ingress: who is calling (API key → tenant) and whether they may, right now.

Keys are kept as sha256 digests only, from the config, a mounted keys file, `STRUCTSERVE_API_KEY`
(the default tenant's key) and Redis (keys created at run time); a presented key is hashed and
compared in constant time against each digest. The tenant comes from the key alone: a client-sent
tenant header means nothing. Rate (requests per minute, a token bucket) and concurrency limits are
kept per ingress replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments.config import ServiceConfig, TenantLimits

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_REDIS_KEYS = "structserve:apikeys"  # hash: sha256 -> tenant


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class AuthError(Exception):
    """401: no key, or a key no tenant holds."""


class LimitError(Exception):
    """429 with `Retry-After` seconds."""

    def __init__(self, message: str, retry_after: float, reason: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class NeverFits(ValueError):
    """A request over a limit no wait can lift (a 400): more choices than concurrent slots."""


@dataclass
class _Bucket:
    capacity: float
    per_second: float
    tokens: float
    stamp: float = field(default_factory=time.monotonic)

    def take(self) -> float:
        """0 when a request may go now, else the seconds until it may."""
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.per_second)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.per_second


class Tenants:
    def __init__(
        self, config: ServiceConfig, default_key: str | None = None, redis: Any | None = None
    ) -> None:
        self.redis = redis
        self.limits: dict[str, TenantLimits] = {DEFAULT_TENANT: TenantLimits()}
        self._digests: list[tuple[str, str]] = []  # (sha256, tenant)
        for t in config.tenants:
            self.limits[t.name] = t.limits
            self._digests += [(d.lower(), t.name) for d in t.api_key_sha256]
        if config.api_keys_file:
            keys = json.loads(Path(config.api_keys_file).read_text())
            for tenant, digests in keys.items():
                self.limits.setdefault(tenant, TenantLimits())
                self._digests += [(d.lower(), tenant) for d in digests]
        if default_key:
            self._digests.append((digest(default_key), DEFAULT_TENANT))
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}
        self._active: dict[str, int] = {}
        self._redis_down = 0.0  # after a failure, runtime keys are not looked up for a while

    async def authenticate(self, authorization: str | None) -> str:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthError("missing API key: send `Authorization: Bearer <key>`")
        presented = digest(authorization[7:].strip())
        tenant = None
        for known, name in self._digests:  # every digest is compared: no early exit to time
            if hmac.compare_digest(known, presented):
                tenant = name
        if tenant is None and self.redis is not None and time.monotonic() >= self._redis_down:
            # a blocking client: off the event loop, so a slow Redis stalls no one else
            tenant = await asyncio.to_thread(self._from_redis, presented)
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant

    def _from_redis(self, presented: str) -> str | None:
        try:
            raw = self.redis.hget(_REDIS_KEYS, presented)  # type: ignore[union-attr]
        except Exception as exc:  # Redis down: configured keys still work
            self._redis_down = time.monotonic() + 5.0
            log.warning("api keys: Redis lookup failed (%s)", exc)
            return None
        return raw.decode() if raw else None

    def add_key(self, tenant: str, api_key: str) -> None:
        """Registers a key at run time (stored hashed in Redis)."""
        if self.redis is None:
            self._digests.append((digest(api_key), tenant))
            return
        self.redis.hset(_REDIS_KEYS, digest(api_key), tenant)

    def limits_of(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant) or self.limits[DEFAULT_TENANT]

    def admit(self, tenant: str, slots: int = 1) -> None:
        """Takes a rate token and `slots` concurrency slots (one per sequence), or raises
        (`NeverFits` when no retry could help)."""
        lim = self.limits_of(tenant)
        if slots > lim.max_concurrent:
            raise NeverFits(
                f"n: {slots} choices need more than this tenant's {lim.max_concurrent} "
                "concurrent requests; ask for fewer"
            )
        with self._lock:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                rate = lim.requests_per_minute
                bucket = self._buckets[tenant] = _Bucket(rate, rate / 60.0, rate)
            if self._active.get(tenant, 0) + slots > lim.max_concurrent:
                raise LimitError(
                    f"the tenant has {lim.max_concurrent} requests running", 1.0, "concurrency"
                )
            wait = bucket.take()
            if wait > 0:
                raise LimitError(
                    f"over {lim.requests_per_minute} requests per minute", wait, "rate"
                )
            self._active[tenant] = self._active.get(tenant, 0) + slots

    def release(self, tenant: str, slots: int = 1) -> None:
        with self._lock:
            self._active[tenant] = max(0, self._active.get(tenant, 0) - slots)
