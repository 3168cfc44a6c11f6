"""The mask-time probe: what admission learns of a grammar's masks before any request decodes
with it. The compile workers probe xgrammar's grammars; `LocalBuilds` probes llguidance's.

An attacker hides a slow mask where one random walk seldom goes: after many choice points
(`([ab]\\n){12}(.?){0,1000}`), behind forced text, or in a branch few tokens enter, which a
request then steers into with `logit_bias` (`(c[a-y ]{0,40}|zqxjv(.?){0,1000})`). So the probe
walks several paths, each past forced text (accepted untimed: timing it would let a long literal
hide what follows) and up to `depth` choice points deep, within `budget_s` of CPU in all:

- the paths its family's slow members took (`hints`: the text that reached their slow mask,
  grammar_registry/family.py), replayed as far as this grammar accepts them, then explored on;
- the rarest branch at every choice point: of the allowed tokens, those whose first byte the
  fewest allowed tokens share (the branch a model rarely enters unless steered);
- a seeded random walk, and one alternating rare and random choices.

Times are CPU time, as the decode-time budget counts them (`masks.py`): a busy host does not
make a cheap grammar look slow. Given `workers` (the compile workers), each fill runs on one of
them and is left behind once it passes `stop_above_ms` of CPU: demoted to the kernel's idle class
(services/grammar/workers.py), it finishes on cores nothing else wants instead of holding a core
and the compile worker for its seconds. Without them (llguidance's probe, whose parser limits
bound each mask) the fills run inline.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.grammar.workers import GrammarWorkers

PROBE_STEPS = 32  # choice points per path
PROBE_BUDGET_S = 0.25  # CPU seconds for the whole probe; a path stops when it is spent


@dataclass(frozen=True)
class Probe:
    median_ms: float  # over every timed mask of every path
    worst_ms: float
    slow_path: str | None  # the text that reached a mask over `stop_above_ms` (None: none did)


def probe_masks(
    backend: Any,
    compiled: Any,
    steps: int,
    seed: int,
    stop_above_ms: float = float("inf"),
    hints: Sequence[str] = (),
    budget_s: float = PROBE_BUDGET_S,
    workers: GrammarWorkers | None = None,
) -> Probe:
    """A single mask slower than `stop_above_ms` ends the probe with the text that reached it."""
    walker = _Walker(backend, compiled, stop_above_ms, budget_s, workers)
    rng = random.Random(seed)
    paths: list[tuple[str, str]] = [(hint, "rare") for hint in hints]
    paths += [("", "rare"), ("", "random"), ("", "alternate")]
    for prefix, how in paths:
        slow = walker.walk(prefix, how, steps, rng)
        if slow is not None or walker.spent():
            break
    times = walker.times
    return Probe(
        statistics.median(times) if times else 0.0,
        max(times, default=0.0),
        walker.slow_path,
    )


class _Walker:
    def __init__(
        self,
        backend: Any,
        compiled: Any,
        stop_above_ms: float,
        budget_s: float,
        workers: GrammarWorkers | None,
    ) -> None:
        self.backend, self.compiled = backend, compiled
        self.stop_above_ms = stop_above_ms
        self.first = first_bytes(backend)  # read once per backend: before the clock starts
        self.left_s = budget_s  # the probe's CPU time left (fills and this thread's own)
        self.started = time.thread_time()
        self.workers = workers
        self.bitmask = backend.allocate_bitmask(1)
        self.times: list[float] = []
        self.slow_path: str | None = None

    def spent(self) -> bool:
        return time.thread_time() - self.started >= self.left_s

    def fill(self, state: Any) -> float:
        """One mask's CPU time (ms); one left behind past the stop counts what it took so far."""
        if self.workers is None:
            start = time.thread_time()
            state.fill_bitmask(self.bitmask, 0)
            ms = (time.thread_time() - start) * 1000
        else:
            job = self.workers.submit([(lambda: state.fill_bitmask(self.bitmask, 0), "probe")])[0]
            while not self.workers.wait([job], 0.005) and job.cpu_seconds() * 1000 <= (
                self.stop_above_ms
            ):
                pass
            ms = job.cpu_seconds() * 1000
            if not job.done:
                self.workers.straggle(job)
                self.workers.demote(job)
            self.left_s -= ms / 1000
        return ms

    def walk(self, prefix: str, how: str, steps: int, rng: random.Random) -> str | None:
        """One path: `prefix` as far as the grammar takes it, then `steps` choice points
        chosen `how`; the text that reached a mask over the stop (None: none did)."""
        state = self.backend.new_state(self.compiled)
        text = _accept_prefix(state, prefix).encode()  # bytes: tokens may split a character
        for step in range(steps):
            if state.is_terminated() or self.spent():  # a terminated matcher raises on any call
                return None
            forced = state.jump_forward()
            if forced and not state.accept_string(forced):
                return None
            text += forced.encode()
            self.times.append(self.fill(state))
            if self.times[-1] > self.stop_above_ms:
                self.slow_path = text.decode("utf-8", "ignore")
                return self.slow_path
            bits = np.unpackbits(self.bitmask[0].numpy().view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: self.backend.vocab_size])
            if allowed.size == 0:
                return None
            rare = how == "rare" or (how == "alternate" and step % 2 == 0)
            token = (
                self._rarest(allowed, rng) if rare else int(allowed[rng.randrange(allowed.size)])
            )
            if not state.accept_token(token):
                return None
            text += _token_bytes(self.backend, token)
        return None

    def _rarest(self, allowed: np.ndarray, rng: random.Random) -> int:
        """A token of the branch the fewest allowed tokens enter (by first byte)."""
        firsts = self.first[allowed]
        counts = np.bincount(firsts, minlength=257)
        present = np.flatnonzero(counts)
        rarest = present[counts[present] == counts[present].min()]
        among = allowed[firsts == rarest[rng.randrange(rarest.size)]]
        return int(among[rng.randrange(among.size)])


def _accept_prefix(state: Any, prefix: str) -> str:
    """Accepts `prefix`, or the longest start of it the grammar takes; returns what it took."""
    if not prefix or state.accept_string(prefix):
        return prefix
    taken = 0
    for ch in prefix:  # the grammar differs somewhere: as far as it goes, a character at a time
        if state.is_terminated() or not state.accept_string(ch):
            break
        taken += 1
    return prefix[:taken]


def _token_bytes(backend: Any, token: int) -> bytes:
    vocab = _vocab(backend)
    return vocab[token] if vocab is not None else b""


def _vocab(backend: Any) -> list[bytes] | None:
    """Each token's bytes: xgrammar's tokenizer info, or llguidance's tokenizer."""
    cached = getattr(backend, "_probe_vocab", None)
    if cached is not None:
        return cached
    vocab: list[bytes] | None = None
    info = getattr(backend, "tokenizer_info", None)
    if info is not None:
        vocab = [bytes(b) for b in info.decoded_vocab]
    elif hasattr(getattr(backend, "tokenizer", None), "decode_bytes"):
        vocab = [backend.tokenizer.decode_bytes([t]) for t in range(backend.vocab_size)]
    if vocab is not None:
        vocab += [b""] * (backend.vocab_size - len(vocab))
        backend._probe_vocab = vocab
    return vocab


def first_bytes(backend: Any) -> np.ndarray:
    """[vocab] each token's first byte (256 for an empty token; the id's low byte without a
    vocabulary)."""
    cached = getattr(backend, "_probe_first", None)
    if cached is not None:
        return cached
    vocab = _vocab(backend)
    if vocab is None:
        first = np.arange(backend.vocab_size) % 256
    else:
        first = np.array([b[0] if b else 256 for b in vocab[: backend.vocab_size]])
    backend._probe_first = first
    return first
