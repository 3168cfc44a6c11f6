"""The two-level compiled-grammar cache: an in-process LRU bounded in bytes, then Redis.

Redis holds a *verdict* per grammar key: compiled (with a compressed xgrammar blob when loading it
beats recompiling, else a "compile locally" marker) or refused (invalid, over a limit, timed out,
too slow to mask; kept for a shorter time). A verdict is small and always worth caching: it lets a
second replica skip the worker pool and the probe. Any Redis error, and any entry it cannot read,
counts as a miss: a request never fails because of the cache.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_MAGIC = b"SSV1"  # entry layout version; anything else is ignored and replaced


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
        header = json.loads(raw[8 : 8 + n])
        blob = raw[8 + n :] or None
        return cls(**header, blob=blob)

    def blob_json(self) -> str:
        assert self.blob is not None
        return zlib.decompress(self.blob).decode()


def compress(blob_json: str) -> bytes:
    return zlib.compress(blob_json.encode(), 1)  # level 1: ~3.3x on these blobs, fast


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

    After an error the store stays quiet for `backoff_s` so a dead Redis costs one timeout, not
    one per request.
    """

    def __init__(
        self,
        client: Any,
        ttl_s: int = 7 * 24 * 3600,
        failure_ttl_s: int = 600,
        max_entry_bytes: int = 64 << 20,
        backoff_s: float = 5.0,
    ) -> None:
        self.client = client
        self.ttl_s, self.failure_ttl_s = ttl_s, failure_ttl_s
        self.max_entry_bytes = max_entry_bytes
        self.backoff_s = backoff_s
        self._down_until = 0.0
        self.errors = 0

    def get(self, key: str) -> Verdict | None:
        raw = self._call("get", key)
        if raw is None:
            return None
        try:
            return Verdict.decode(raw)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            log.warning("grammar cache: unreadable entry %s, ignored", key[-12:])
            return None

    def put(self, key: str, verdict: Verdict) -> bool:
        raw = verdict.encode()
        if len(raw) > self.max_entry_bytes:  # keep the verdict, drop the blob
            verdict = Verdict(**{**asdict(verdict), "blob": None})
            raw = verdict.encode()
        ttl = self.ttl_s if verdict.ok else self.failure_ttl_s
        return self._call("set", key, raw, ex=ttl) is not None

    def delete(self, key: str) -> None:
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
