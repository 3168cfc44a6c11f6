"""Incremental detokenization and stop-string matching, O(1) work per token.

Decoding the whole output every step is quadratic; instead, as vLLM does, decode a short window
(`prefix_offset:`) and emit what grew past the text already read. A window that ends inside a
multi-byte character decodes to U+FFFD and is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 6  # prompt tokens decoded with the output so the first word keeps its space


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.text = ""
        self._emitted = 0  # characters of `text` already handed to the caller
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add_tokens(self, token_ids: list[int]) -> None:
        """Extends `text`; sets `stopped` (and cuts the text before it) when a stop string shows."""
        for tid in token_ids:
            if self.stopped:
                return
            self._ids.append(tid)
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
        if not self._stop:
            return
        start = max(0, before - self._max_stop + 1)
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
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
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest
