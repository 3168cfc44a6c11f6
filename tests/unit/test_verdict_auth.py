"""Redis verdict entries are authenticated and bounded: whoever can write to Redis cannot plant an
`ok` verdict (every replica would compile that grammar in-process) or a decompression bomb. Every
entry that fails a check is a miss, counted by reason and deleted so it is compiled again."""

from __future__ import annotations

import logging
import tracemalloc
import zlib
from typing import Any

import fakeredis
import pytest
import xgrammar as xgr

from grammar_registry import GrammarSpec, RedisVerdicts, Verdict
from grammar_registry import cache as cache_module
from grammar_registry.cache import compress
from services.compiler import CompilerConfig, CompileService

SECRET = b"unit-test-verdict-secret-0001"
KEY = "grammar:xgrammar-0.1:v1:tok:regex:abc"
BLOB_JSON = '{"grammar": "' + "root ::= [a-z]+ " * 200 + '"}'


def good_verdict() -> Verdict:
    blob = compress(BLOB_JSON)
    return Verdict(ok=True, warnings=["#/x"], compile_s=0.4, load_s=0.01, blob=blob, blob_bytes=9)


class Recording(fakeredis.FakeRedis):
    """fakeredis that remembers how many bytes each read brought over."""

    read_sizes: list[int]

    def getrange(self, *args: Any, **kwargs: Any) -> Any:
        out = super().getrange(*args, **kwargs)
        self.read_sizes = [*getattr(self, "read_sizes", []), len(out)]
        return out


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


@pytest.fixture
def store(r: fakeredis.FakeRedis) -> RedisVerdicts:
    return RedisVerdicts(r, secret=SECRET)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """128 MiB of zeros in ~130 KB: inflating it whole would hold 128 MiB."""
    c = zlib.compressobj(9)
    return b"".join(c.compress(bytes(1 << 20)) for _ in range(128)) + c.flush()


def test_a_good_entry_round_trips_inside_the_envelope(r, store):
    verdict = good_verdict()
    assert store.put(KEY, verdict)
    raw = r.get(KEY)
    payload = verdict.encode()
    assert raw[:4] == b"SSE1" and len(raw) == 4 + 32 + len(payload) and raw[36:] == payload
    got = store.get(KEY)
    assert got == verdict and got.blob_json() == BLOB_JSON
    refusal = Verdict(ok=False, reason="timeout", error="too slow")
    store.put(KEY + ":tenant:a", refusal)
    assert store.get(KEY + ":tenant:a") == refusal
    assert store.rejected == {}


def _forged_ok() -> bytes:
    # what an attacker with Redis access writes: "compiles fine, no blob: compile it locally"
    return b"SSE1" + bytes(32) + Verdict(ok=True, compile_s=0.01).encode()


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :]


TAMPERED = {
    # name: (make the stored bytes from a good sealed entry, the reason counted)
    "forged ok, made-up MAC": (lambda raw: _forged_ok(), "mac"),
    "MAC bit flipped": (lambda raw: _flip(raw, 10), "mac"),
    "payload bit flipped": (lambda raw: _flip(raw, len(raw) - 5), "mac"),
    "truncated": (lambda raw: raw[:-7], "mac"),
    "tag cut short": (lambda raw: raw[:20], "mac"),
    "no envelope (a pre-envelope entry)": (lambda raw: raw[36:], "format"),
    "other magic": (lambda raw: b"SSE9" + raw[4:], "format"),
}


@pytest.mark.parametrize("case", TAMPERED, ids=list(TAMPERED))
def test_a_tampered_entry_is_a_miss_and_is_deleted(r, store, case):
    make, reason = TAMPERED[case]
    store.put(KEY, good_verdict())
    r.set(KEY, make(r.get(KEY)))
    assert store.get(KEY) is None
    assert r.exists(KEY) == 0  # gone: the next lookup compiles and stores a good one
    assert store.rejected == {reason: 1}


def test_an_entry_moved_to_another_key_does_not_verify(r, store):
    store.put(KEY, Verdict(ok=True))
    other = KEY.replace("abc", "pathological")
    r.set(other, r.get(KEY))  # a genuine entry, replayed for another grammar
    assert store.get(other) is None and r.exists(other) == 0
    assert store.get(KEY) == Verdict(ok=True)  # the original still reads
    assert store.rejected == {"mac": 1}


def test_an_oversized_entry_is_refused_before_mac_or_inflate(monkeypatch):
    r = Recording()
    big = RedisVerdicts(r, max_entry_bytes=1 << 20, secret=SECRET)  # same secret, larger cap
    blob = compress("".join(f"{i:08x}" for i in range(20_000)))  # ~90 KB compressed
    assert big.put(KEY, Verdict(ok=True, blob=blob, blob_bytes=len(blob)))
    assert len(r.get(KEY)) > 10_000
    small = RedisVerdicts(r, max_entry_bytes=10_000, secret=SECRET)
    calls: list[str] = []

    def spy(name: str, real: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(zlib, "decompressobj", spy("decompressobj", zlib.decompressobj))
    monkeypatch.setattr(zlib, "decompress", spy("decompress", zlib.decompress))
    monkeypatch.setattr(
        cache_module.hmac, "compare_digest", spy("compare_digest", cache_module.hmac.compare_digest)
    )
    monkeypatch.setattr(cache_module.Verdict, "decode", spy("decode", Verdict.decode))
    assert small.get(KEY) is None
    assert calls == []  # neither verified, parsed nor inflated
    assert r.read_sizes == [10_001]  # and no more than the cap (+1) crossed the wire
    assert r.exists(KEY) == 0 and small.rejected == {"oversize": 1}


def test_a_bomb_under_a_valid_mac_is_a_miss_bounded_in_memory(r, store, bomb):
    planted = Verdict(ok=True, blob=bomb, blob_bytes=len(bomb))
    r.set(KEY, store._seal(KEY, planted.encode()))  # as if the secret had leaked
    tracemalloc.start()
    try:
        assert store.get(KEY) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # one inflate chunk and the entry, never the 128 MiB
    assert r.exists(KEY) == 0 and store.rejected == {"inflate": 1}


def test_a_bomb_never_inflates_whole_anywhere_else(r, store, bomb):
    planted = Verdict(ok=True, blob=bomb, blob_bytes=len(bomb))
    with pytest.raises(ValueError, match="inflates past"):
        planted.blob_json()  # a replica given such a verdict refuses it (then asks afresh)
    assert store.put(KEY, planted)  # our own writer keeps the verdict and drops the blob
    got = store.get(KEY)
    assert got is not None and got.ok and got.blob is None


def test_an_unreadable_payload_under_a_valid_mac_is_a_miss(r, store):
    for payload in (b"SSV1" + (999).to_bytes(4, "big") + b"{}", Verdict(ok=True).encode()[:-3]):
        r.set(KEY, store._seal(KEY, payload))
        assert store.get(KEY) is None and r.exists(KEY) == 0
    r.set(KEY, store._seal(KEY, Verdict(ok=True, blob=b"not zlib").encode()))
    assert store.get(KEY) is None and r.exists(KEY) == 0
    assert store.rejected == {"unreadable": 3}


def test_rotating_the_secret_turns_old_entries_into_misses(r, store):
    store.put(KEY, good_verdict())
    rotated = RedisVerdicts(r, secret=b"the-next-verdict-secret-0002")
    assert rotated.get(KEY) is None and r.exists(KEY) == 0
    assert rotated.rejected == {"mac": 1}
    rotated.put(KEY, good_verdict())
    assert rotated.get(KEY) == good_verdict()
    assert store.get(KEY) is None  # and the old secret cannot read the new entries


def test_refusals_warn_once_per_reason_then_quietly(r, store, caplog):
    caplog.set_level(logging.DEBUG, logger="grammar_registry.cache")
    for _ in range(3):
        r.set(KEY, _forged_ok())
        assert store.get(KEY) is None
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "mac" in warnings[0].getMessage()
    assert store.rejected == {"mac": 3}


def test_redis_needs_a_secret_and_no_redis_needs_none(r):
    with pytest.raises(ValueError, match="needs a secret"):
        RedisVerdicts(r)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RedisVerdicts(r, secret=b"short")
    offline = RedisVerdicts(None)  # in-process only: nothing stored, nothing to authenticate
    assert offline.put(KEY, Verdict(ok=True)) is False and offline.get(KEY) is None


class RefusingPool:
    """Stands in for the worker pool: records that a compile was asked for."""

    def __init__(self) -> None:
        self.jobs = 0

    def run(
        self, job: dict[str, Any], deadline_s: float, wait_s: float, tenant: str = "default"
    ) -> dict[str, Any]:
        self.jobs += 1
        return {"ok": False, "reason": "timeout", "error": "over the deadline", "compile_s": 1.0}

    def restarting(self, tenant: str) -> int:
        return 0

    def close(self) -> None:
        pass


def test_the_service_ignores_a_forged_ok_and_compiles_under_its_guard(r):
    info = xgr.TokenizerInfo(["a", "b", "c"])
    with pytest.raises(ValueError, match="needs a secret"):
        CompileService(info, CompilerConfig(), redis=r)
    pool = RefusingPool()
    config = CompilerConfig(verdict_secret=SECRET.decode())
    service = CompileService(info, config, redis=r, pool=pool)  # type: ignore[arg-type]
    spec = GrammarSpec(kind="regex", source="(a|aa)*b")
    r.set(service.key(spec), _forged_ok())
    verdict = service.verdict(spec)
    # the forged "ok" was not believed: worker compiles decided (a timeout is tried twice)
    assert pool.jobs == 2
    assert not verdict.ok and verdict.reason == "timeout"
    assert service.verdicts.rejected == {"mac": 1}
