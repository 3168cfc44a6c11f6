"""Incremental detokenization and stop-string matching, O(1) work per token.

Decoding the whole output every step is quadratic; instead, as vLLM does, decode a short window
(`prefix_offset:`) and emit what grew past the text already read. A window that ends inside a
multi-byte character decodes to U+FFFD and is held back until the next token completes it.

Stop strings are matched by `StopMatcher`, which reads each new character once: rescanning a tail
as long as the longest stop string, or testing every prefix of every stop string for the held-back
tail, costs a tenant-chosen amount per token on the engine thread, paid by the whole batch.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 6  # prompt tokens decoded with the output so the first word keeps its space


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: tuple[str, ...],
        min_tokens: int = 0,  # stop strings found before this many tokens do not stop
    ) -> None:
        self._tokenizer = tokenizer
        self._min_tokens = min_tokens
        self._added = 0
        self._context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._stops = stop
        self._ids: list[int] = list(self._context)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = StopMatcher(stop) if stop else None
        self.text = ""
        self._emitted = 0  # characters of `text` already handed to the caller
        self.stopped = False

    def rewound(self, output_ids: list[int]) -> IncrementalDetokenizer:
        """A fresh detokenizer on the same prompt and stop strings, fed `output_ids`."""
        fresh = IncrementalDetokenizer(
            self._tokenizer, self._context, self._stops, min_tokens=self._min_tokens
        )
        fresh.add_tokens(output_ids)
        return fresh

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add_tokens(self, token_ids: list[int]) -> None:
        """Extends `text`; sets `stopped` (and cuts the text before it) when a stop string shows."""
        for tid in token_ids:
            if self.stopped:
                return
            self._ids.append(tid)
            self._added += 1
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue
            before = len(self.text)
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._check_stop(before)

    def _check_stop(self, before: int) -> None:
        if self._stop is None:
            return
        cut = self._stop.feed(self.text, before)  # fed in any case: a later match may span it
        if cut is not None and self._added >= self._min_tokens:
            self.text = self.text[:cut]
            self.stopped = True

    def take_delta(self, final: bool) -> str:
        """The text not yet emitted; while running, holds back a tail that could begin a stop."""
        end = len(self.text)
        if not final and self._stop:
            end -= self._partial_stop_len()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        return self._stop.partial if self._stop is not None else 0


class StopMatcher:
    """Knuth-Morris-Pratt over several patterns: for each stop string, how many of its first
    characters the text ends with. Feeding a character is amortized O(1) per stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._fail = [_failure(s) for s in stops]
        self._matched = [0] * len(stops)

    @property
    def partial(self) -> int:
        """The longest tail of the text that could still become a stop string."""
        return max(self._matched, default=0)

    def feed(self, text: str, start: int) -> int | None:
        """Reads `text[start:]` (the new characters); the index where the text must be cut (the
        start of the first stop string completed, the longest when several end together)."""
        for pos in range(start, len(text)):
            ch = text[pos]
            cut = None
            for i, stop in enumerate(self._stops):
                k, fail = self._matched[i], self._fail[i]
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    first = pos + 1 - k
                    cut = first if cut is None else min(cut, first)
                    k = fail[k - 1]
                self._matched[i] = k
            if cut is not None:
                return cut
        return None


def _failure(pattern: str) -> list[int]:
    """`fail[i]`: the longest proper prefix of `pattern[: i + 1]` that is also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail
