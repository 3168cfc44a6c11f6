"""The two-level compiled-grammar cache: an in-process LRU bounded in bytes, then Redis.

Redis holds a *verdict* per grammar key: compiled (with a compressed xgrammar blob when loading it
beats recompiling, else a "compile locally" marker) or refused (invalid, over a limit, timed out,
too slow to mask; kept for a shorter time); each names the backend it is for. A verdict is small
and always worth caching: it lets a second replica skip the worker pool and the probe. Any Redis
error, and any entry it cannot read, counts as a miss: a request never fails because of the cache.

Redis is outside the trust boundary: whoever can write to it could plant an `ok` verdict for a
pathological grammar (every replica would then compile it in-process) or a decompression bomb. So
each entry is an authenticated envelope,

    b"SSE1" | HMAC-SHA256(k, b"SSE1" | len(key) as 4 bytes | key | payload) (32 bytes) | payload

with `payload = Verdict.encode()` and `k` derived from the deployment's secret. The key is inside
the MAC, so an entry copied to another key does not verify. A reader takes at most
`max_entry_bytes + 1` bytes (GETRANGE), refuses an oversized entry before anything else, checks the
MAC in constant time before parsing, and inflates a blob at most to `max_inflate_ratio` times its
size. An entry that fails any of these is a miss: counted, logged (once a minute per reason), and
deleted so that it is compiled again. A new secret turns every old entry into such a miss.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_MAGIC = b"SSV1"  # verdict layout version (the envelope's payload)
_ENVELOPE = b"SSE1"  # envelope layout version; anything else is ignored and replaced
_TAG_BYTES = 32  # HMAC-SHA256
_HEAD_BYTES = len(_ENVELOPE) + _TAG_BYTES
_KEY_LABEL = b"structserve/grammar-verdicts/v1"  # the MAC key is HMAC(secret, label)
MIN_SECRET_BYTES = 16
# A blob inflates to at most this many times its compressed size (and always to 1 MiB): well above
# what a real compiled grammar compresses by at zlib level 1, far below a zlib bomb's ratio.
INFLATE_RATIO = 32
_INFLATE_FLOOR = 1 << 20
_INFLATE_CHUNK = 1 << 20
_LOG_EVERY_S = 60.0


@dataclass
class Verdict:
    """What compiling a grammar showed. `blob` is the zlib-compressed `serialize_json()` or None."""

    ok: bool
    error: str = ""
    reason: str = ""  # for refusals: invalid | limit | timeout | slow_mask | fidelity | memory
    warnings: list[str] = field(default_factory=list)
    compile_s: float = 0.0
    load_s: float = 0.0  # decompress + deserialize, measured right after compiling
    mask_ms: float = 0.0  # p50 of the probe's masks
    blob_bytes: int = 0
    blob: bytes | None = None
    # the grammar backend it is for (its blob is that backend's): the service's are xgrammar's;
    # llguidance's stay in the replica that built them (services/compiler/local_builds.py)
    backend: str = "xgrammar"
    # a family record's slow members (grammar_registry/family.py): {"counts", "path"} each
    slow: list[dict[str, Any]] = field(default_factory=list)
    # where this answer came from (telemetry's cache level: recent, redis, compiled, rejected);
    # per lookup, so never stored
    source: str = ""

    def encode(self) -> bytes:
        header = {k: v for k, v in asdict(self).items() if k not in ("blob", "source")}
        head = json.dumps(header).encode()
        return _MAGIC + len(head).to_bytes(4, "big") + head + (self.blob or b"")

    @classmethod
    def decode(cls, raw: bytes) -> Verdict:
        if raw[:4] != _MAGIC:
            raise ValueError("not a structserve verdict")
        n = int.from_bytes(raw[4:8], "big")
        if 8 + n > len(raw):
            raise ValueError("truncated verdict header")
        header = json.loads(raw[8 : 8 + n])
        if not isinstance(header, dict) or not isinstance(header.get("ok"), bool):
            raise ValueError("malformed verdict header")
        blob = raw[8 + n :] or None
        return cls(**header, blob=blob)

    def blob_json(self, max_ratio: int = INFLATE_RATIO) -> str:
        """The serialized grammar; raises `ValueError` past `inflate_limit` (a bomb)."""
        assert self.blob is not None
        d = zlib.decompressobj()
        limit = inflate_limit(self.blob, max_ratio)
        out = d.decompress(self.blob, limit + 1)
        if len(out) > limit or d.unconsumed_tail:
            raise ValueError(f"blob inflates past {limit} bytes")
        if not d.eof:
            raise ValueError("truncated blob")
        return out.decode()


def compress(blob_json: str) -> bytes:
    return zlib.compress(blob_json.encode(), 1)  # level 1: most of the gain, little of the time


def inflate_limit(blob: bytes, max_ratio: int = INFLATE_RATIO) -> int:
    return max(_INFLATE_FLOOR, max_ratio * len(blob))


def inflates_within(blob: bytes, limit: int) -> bool:
    """Whether `blob` inflates to at most `limit` bytes, holding one chunk at a time (so a bomb
    costs `limit` bytes of inflating, never of memory). Raises `zlib.error` on a corrupt blob."""
    d = zlib.decompressobj()
    total, rest = 0, blob
    while not d.eof:
        out = d.decompress(rest, _INFLATE_CHUNK)
        total += len(out)
        if total > limit:
            return False
        rest = d.unconsumed_tail
        if not out and not rest:
            raise zlib.error("truncated blob")
    return True


class LRUBytes:
    """Thread-safe LRU bounded by the summed size its caller assigns to each entry."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: str, value: Any, size: int) -> None:
        if size > self.max_bytes:
            return  # never evict everything for one entry
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped

    def pop(self, key: str) -> Any | None:
        with self._lock:
            hit = self._items.pop(key, None)
            if hit is None:
                return None
            self.bytes -= hit[1]
            return hit[0]

    def __len__(self) -> int:
        return len(self._items)


class RedisVerdicts:
    """Verdicts in Redis with TTLs and a per-entry byte cap; every failure is a miss.

    `secret` keys the entries' MAC; it is required with a client (the service's chart generates
    one and every process that shares the Redis must hold the same). There is no unauthenticated
    mode and no derived or per-process secret: without a client nothing is stored and no secret is
    needed. After a Redis error the store stays quiet for `backoff_s` so a dead Redis costs one
    timeout, not one per request. `rejected` counts the entries refused, by reason.
    """

    def __init__(
        self,
        client: Any,
        ttl_s: int = 7 * 24 * 3600,
        failure_ttl_s: int = 600,
        max_entry_bytes: int = 64 << 20,
        backoff_s: float = 5.0,
        *,
        secret: bytes | None = None,
        max_inflate_ratio: int = INFLATE_RATIO,
    ) -> None:
        if client is not None and secret is None:
            raise ValueError(
                "a Redis verdict cache needs a secret (CompilerConfig.verdict_secret): its "
                "entries are authenticated, and every process sharing the Redis must hold it"
            )
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the verdict secret needs at least {MIN_SECRET_BYTES} bytes")
        self.client = client
        self.ttl_s, self.failure_ttl_s = ttl_s, failure_ttl_s
        self.max_entry_bytes = max_entry_bytes
        self.max_inflate_ratio = max_inflate_ratio
        self.backoff_s = backoff_s
        self._down_until = 0.0
        self.errors = 0
        self.rejected: dict[str, int] = {}
        self._quiet_until: dict[str, float] = {}
        self._lock = threading.Lock()
        key = hmac.new(secret or b"", _KEY_LABEL, hashlib.sha256).digest()
        self._mac = hmac.new(key, digestmod=hashlib.sha256)

    def get(self, key: str) -> Verdict | None:
        # at most one byte past the cap crosses the wire: a planted giant entry is never read
        raw = self._call("getrange", key, 0, self.max_entry_bytes)
        if not raw:  # missing (GETRANGE answers b"") or empty
            return None
        verdict, refused = self._open(key, raw)
        if verdict is None:
            self._reject(key, refused)
        return verdict

    def _open(self, key: str, raw: Any) -> tuple[Verdict | None, str]:
        """The entry's verdict, or None and why not; checks in order of cost, so that nothing
        unauthenticated is parsed and nothing oversized is even authenticated."""
        if len(raw) > self.max_entry_bytes:
            return None, "oversize"
        if not isinstance(raw, bytes) or raw[: len(_ENVELOPE)] != _ENVELOPE:
            return None, "format"  # includes entries written before the envelope
        if len(raw) < _HEAD_BYTES or not hmac.compare_digest(
            raw[len(_ENVELOPE) : _HEAD_BYTES], self._tag(key, memoryview(raw)[_HEAD_BYTES:])
        ):
            return None, "mac"  # forged, moved from another key, or under another secret
        try:
            verdict = Verdict.decode(raw[_HEAD_BYTES:])
            fits = verdict.blob is None or inflates_within(verdict.blob, self._limit(verdict.blob))
        except (ValueError, KeyError, TypeError, zlib.error):  # JSONDecodeError is a ValueError
            return None, "unreadable"
        return (verdict, "") if fits else (None, "inflate")

    def put(self, key: str, verdict: Verdict) -> bool:
        if self.client is None:
            return False
        if verdict.blob is not None and not self._fits(verdict.blob):
            verdict = Verdict(**{**asdict(verdict), "blob": None})  # get would refuse it
        raw = self._seal(key, verdict.encode())
        if len(raw) > self.max_entry_bytes:  # keep the verdict, drop the blob
            verdict = Verdict(**{**asdict(verdict), "blob": None})
            raw = self._seal(key, verdict.encode())
        ttl = self.ttl_s if verdict.ok else self.failure_ttl_s
        return self._call("set", key, raw, ex=ttl) is not None

    def delete(self, key: str) -> None:
        self._call("delete", key)

    def _tag(self, key: str, payload: bytes | memoryview) -> bytes:
        name = key.encode()
        mac = self._mac.copy()
        mac.update(_ENVELOPE + len(name).to_bytes(4, "big") + name)
        mac.update(payload)
        return mac.digest()

    def _seal(self, key: str, payload: bytes) -> bytes:
        return _ENVELOPE + self._tag(key, payload) + payload

    def _limit(self, blob: bytes) -> int:
        return inflate_limit(blob, self.max_inflate_ratio)

    def _fits(self, blob: bytes) -> bool:
        try:
            return inflates_within(blob, self._limit(blob))
        except zlib.error:
            return True  # not ours to judge here: get refuses it, and the entry is recompiled

    def _reject(self, key: str, reason: str) -> None:
        """An entry that fails a check: a miss, counted, logged once a minute per reason, and
        deleted so the next lookup compiles and stores a good one."""
        now = time.monotonic()
        with self._lock:
            count = self.rejected[reason] = self.rejected.get(reason, 0) + 1
            loud = now >= self._quiet_until.get(reason, 0.0)
            if loud:
                self._quiet_until[reason] = now + _LOG_EVERY_S
        log.log(
            logging.WARNING if loud else logging.DEBUG,
            "grammar cache: %s entry %s refused (%d so far), deleted; compiling instead",
            reason,
            key[-12:],
            count,
        )
        self._call("delete", key)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.client is None or time.monotonic() < self._down_until:
            return None
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except Exception as exc:  # any Redis trouble (connection, timeout, OOM) is a miss
            self.errors += 1
            self._down_until = time.monotonic() + self.backoff_s
            log.warning("grammar cache: Redis %s failed (%s); compiling instead", method, exc)
            return None
