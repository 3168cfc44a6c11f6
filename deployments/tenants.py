"""Tenants at the ingress: who is calling (API key → tenant) and whether they may, right now.

Keys are kept as sha256 digests only, from the config, a mounted keys file, `STRUCTSERVE_API_KEY`
(the default tenant's key) and Redis (keys created at run time); a presented key is hashed and
compared in constant time against each digest. The tenant comes from the key alone: a client-sent
tenant header means nothing. A key is revoked without a restart: the keys file is read again when
it changes, and Redis keys are looked up per request (`structserve keys revoke`).

Limits (requests per minute, concurrent requests, tokens per minute) hold for the whole service:
deployments/quota.py counts them in Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from deployments.quota import LEASE_S, Lease, Quota
from deployments.service_config import TENANT_NAME, ServiceConfig, TenantLimits

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_REDIS_KEYS = "structserve:apikeys"  # hash: sha256 -> tenant
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
RELOAD_S = 2.0  # the keys file is checked for changes at most this often
REDIS_RETRY_S = 5.0  # after a failed key lookup Redis is not asked again for this long


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class AuthError(Exception):
    """401: no key, or a key no tenant holds."""


class AuthUnavailable(Exception):
    """503: the key is not one of the configured ones and Redis, which may hold it, cannot be
    asked now (a 401 would tell a valid key's holder it was revoked)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NeverFits(ValueError):
    """A request over a limit no wait can lift (a 400): more choices than concurrent slots."""


class Tenants:
    def __init__(
        self, config: ServiceConfig, default_key: str | None = None, redis: Any | None = None
    ) -> None:
        self.redis = redis
        self.limits: dict[str, TenantLimits] = {DEFAULT_TENANT: TenantLimits()}
        self._static: list[tuple[str, str]] = []  # (sha256, tenant) from the config
        for t in config.tenants:
            self.limits[t.name] = t.limits
            self._static += [(d.lower(), t.name) for d in t.api_key_sha256]
        if default_key:
            self._static.append((digest(default_key), DEFAULT_TENANT))
        self._keys_file = Path(config.api_keys_file) if config.api_keys_file else None
        self._file: list[tuple[str, str]] = []
        self._file_stamp: tuple[float, int] | None = None
        self._file_checked = -RELOAD_S
        self._reload()
        self.quota = Quota(redis, config.ingress.num_replicas)
        self._renewing: asyncio.Task[None] | None = None
        self._redis_down = 0.0  # after a failure, runtime keys are not looked up for a while

    # -- who is calling ---------------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> str:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthError("missing API key: send `Authorization: Bearer <key>`")
        presented = digest(authorization[7:].strip())
        if time.monotonic() - self._file_checked >= RELOAD_S:
            self._reload()
        tenant = None
        for known, name in (*self._static, *self._file):  # all compared: no early exit to time
            if hmac.compare_digest(known, presented):
                tenant = name
        if tenant is None and self.redis is not None:
            if time.monotonic() < self._redis_down:
                raise _unavailable(self._redis_down - time.monotonic())
            # a blocking client: off the event loop, so a slow Redis stalls no one else
            tenant = await asyncio.to_thread(self._from_redis, presented)
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant

    def _reload(self) -> None:
        """Reads the keys file again when it changed (a Secret's update, a key revoked); an
        unreadable or invalid file keeps the keys read before, and says why in the log."""
        self._file_checked = time.monotonic()
        if self._keys_file is None:
            return
        try:
            st = self._keys_file.stat()
            stamp = (st.st_mtime, st.st_size)
            if stamp == self._file_stamp:
                return
            self._file = parse_keys(json.loads(self._keys_file.read_text()))
            self._file_stamp = stamp
        except (OSError, ValueError) as exc:
            log.error("api keys file %s not loaded: %s", self._keys_file.name, exc)
            return
        for _, tenant in self._file:
            self.limits.setdefault(tenant, TenantLimits())
        log.info("api keys file loaded: %d keys", len(self._file))

    def _from_redis(self, presented: str) -> str | None:
        try:
            raw = self.redis.hget(_REDIS_KEYS, presented)  # type: ignore[union-attr]
        except Exception as exc:  # Redis down: configured keys still work, the rest wait
            self._redis_down = time.monotonic() + REDIS_RETRY_S
            log.warning("api keys: Redis lookup failed (%s)", exc)
            raise _unavailable(REDIS_RETRY_S) from exc
        return raw.decode() if raw else None

    def limits_of(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant) or self.limits[DEFAULT_TENANT]

    # -- whether they may, now --------------------------------------------------------------

    async def admit(self, tenant: str, slots: int = 1, tokens_only: bool = False) -> Lease:
        """A lease on a rate token and `slots` concurrency slots, or `LimitError` (429);
        `tokens_only`: on the tenant's tokens per minute alone (a batch line)."""
        self.check_fits(tenant, slots)
        loop = asyncio.get_running_loop()
        if self._renewing is None and self.redis is not None:
            self._renewing = loop.create_task(self._renew())
        lim = self.limits_of(tenant)
        if tokens_only:
            taking = loop.run_in_executor(None, self.quota.admit_tokens, tenant, lim)
        else:
            taking = loop.run_in_executor(None, self.quota.admit, tenant, lim, slots)
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:  # the client left while its slot was being taken:
            taking.add_done_callback(self._release_taken)  # give it back once it is
            raise

    def _release_taken(self, taking: asyncio.Future[Lease]) -> None:
        if not taking.cancelled() and taking.exception() is None:
            self.release(taking.result())

    async def grow(self, lease: Lease, slots: int) -> None:
        """`slots` more concurrency slots on an admitted request (its extra choices)."""
        if lease.tokens_only:  # a batch line's choices are bounded by the runner, as its lines
            return
        self.check_fits(lease.tenant, lease.slots + slots)
        await asyncio.to_thread(self.quota.grow, lease, self.limits_of(lease.tenant), slots)

    def check_fits(self, tenant: str, slots: int) -> None:
        lim = self.limits_of(tenant)
        if slots > lim.max_concurrent:
            raise NeverFits(
                f"n: {slots} choices need more than this tenant's {lim.max_concurrent} "
                "concurrent requests; ask for fewer"
            )

    def release(self, lease: Lease, tokens: int = 0) -> asyncio.Future[None]:
        """Frees the lease's slots and charges `tokens`. Idempotent (the first call counts) and
        it never blocks, so every exit path, a cancelled one too, may call it; a request that
        ends normally awaits it before answering, so the client's next request finds its slot
        free."""
        loop = asyncio.get_running_loop()
        if lease.released:
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            return done
        lim = self.limits_of(lease.tenant)
        return loop.run_in_executor(None, self.quota.release, lease, lim, tokens)

    async def _renew(self) -> None:
        """Keeps this replica's leases alive in Redis while their requests run."""
        while True:
            await asyncio.sleep(LEASE_S / 3)
            try:
                await asyncio.to_thread(self.quota.renew)
            except Exception:  # a failed renewal is retried; the quota logs Redis failures
                log.debug("lease renewal failed", exc_info=True)


def _unavailable(wait: float) -> AuthUnavailable:
    message = "API keys kept in Redis cannot be checked now (Redis is unreachable); try again"
    return AuthUnavailable(message, max(1.0, wait))


def parse_keys(raw: Any) -> list[tuple[str, str]]:
    """A keys file's `{tenant: [sha256, ...]}` as (digest, tenant) pairs; ValueError naming the
    first bad tenant name or digest."""
    if not isinstance(raw, dict):
        raise ValueError("expected an object {tenant: [sha256, ...]}")
    pairs = []
    for tenant, digests in raw.items():
        check_tenant(tenant)
        if not isinstance(digests, list):
            raise ValueError(f"{tenant}: expected a list of sha256 digests")
        for d in digests:
            if not isinstance(d, str) or not _SHA256.fullmatch(d):
                raise ValueError(f"{tenant}: {str(d)[:80]!r} is not a sha256 hex digest")
            pairs.append((d.lower(), tenant))
    return pairs


def check_tenant(name: Any) -> str:
    if not isinstance(name, str) or not re.fullmatch(TENANT_NAME, name):
        raise ValueError(f"tenant name {str(name)[:80]!r} must match {TENANT_NAME}")
    return name


# -- keys created at run time (the CLI's `keys` command) -------------------------------------


def add_key(redis: Any, tenant: str, api_key: str) -> str:
    """Stores a key (hashed) for `tenant`; returns its digest."""
    check_tenant(tenant)
    d = digest(api_key)
    redis.hset(_REDIS_KEYS, d, tenant)
    return d


def revoke_key(redis: Any, key_or_digest: str) -> bool:
    """Deletes a key by the key itself or its sha256 digest; every ingress refuses it from the
    next request on (Redis keys are looked up per request, never cached)."""
    d = key_or_digest.lower() if _SHA256.fullmatch(key_or_digest) else digest(key_or_digest)
    return bool(redis.hdel(_REDIS_KEYS, d))


def list_keys(redis: Any) -> list[tuple[str, str]]:
    """(digest, tenant) of every key in Redis."""
    rows = redis.hgetall(_REDIS_KEYS)
    return sorted((k.decode(), v.decode()) for k, v in rows.items())
