"""Speculative decoding without a draft model: prompt-lookup (n-gram) drafts, verified in the
step's one forward pass.

Structured outputs copy from their prompt (names, ids, quotes, keys) and from themselves (the keys
of every object in an array), so the tokens after the latest earlier occurrence of the output's
last n tokens are a good guess of what comes next (vLLM's `ngram` method, the same keys).

- **Drafting** (`Speculator.propose`, before scheduling): for each running request about to
  decode, the longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred
  before; the up to `num_speculative_tokens` tokens that followed it are the draft. A constrained
  request's draft is cut at the first token its grammar refuses (the matcher accepts the draft,
  then rolls back), so no position is spent on a token the mask would forbid. With
  `draft_length="adaptive"` a request that missed drafts short until its drafts are kept again.
- **Verifying** (`Speculator.verify`, after the forward): the scheduler computed the draft's
  positions with the request's last token (one multi-token row, `ScheduledChunk.draft`), so the
  forward gave logits at every position. They are walked in order exactly as plain decode steps
  would be (penalties, the grammar's mask for the matcher as it stands, the sampler, then
  `advance`: grammar, stops, jump-forward): greedy keeps the argmax, so the tokens are those of
  plain decoding; sampling keeps the draft token with its probability and otherwise draws from
  the rest (`sampler.accept_or_resample`), so the output distribution is unchanged. The walk stops
  at the first token that differs from the draft: that token is appended (its key and value are
  computed next step, like any sampled token) and the draft's positions after it are left in the
  request's pages past `num_computed_tokens`, where nothing reads them and the next step
  overwrites them: the KV cache "rolls back" by not counting them.
- **When**: every step unless more than `disable_by_batch_size` requests are running (vLLM's
  key; None, the default, never stops).
- **Who speculates**: requests with the `full` KV policy. The other policies' state follows every
  computed token (Quest's page bounds, H2O's scores, the windows' evictions) and a rejected token
  would leave its trace there, so their requests decode plainly (they fall back, never fail).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.engine import logits as logits_processors
from services.engine.config import SpeculativeConfig
from services.engine.request import Request
from services.grammar.backend import GrammarError

if TYPE_CHECKING:
    from services.engine.failures import Boundary
    from services.engine.sampler import Sampled
    from services.engine.scheduler import ScheduledChunk
    from services.engine.token_path import Stage


def ngram_draft(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` (`n_max` down to `n_min` tokens long); [] when none occurred."""
    size = len(tokens)
    if k < 1 or size <= n_min:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # [size - n, n] windows; the last one is the suffix itself, so it is left out
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


@dataclass
class SampleRows:
    """A step's sampling rows: one per plain request, 1 + len(draft) per drafted chunk (its
    logits rows follow the chunk's order, as `ModelRunner.forward` returns them)."""

    plain: list[Request] = field(default_factory=list)
    plain_rows: list[int] = field(default_factory=list)
    drafted: list[tuple[ScheduledChunk, int]] = field(default_factory=list)  # chunk, first row
    counts: dict[int, int] = field(default_factory=dict)  # id(request) -> its rows
    order: list[Request] = field(default_factory=list)  # every sampling request, in row order

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> SampleRows:
        rows, at = cls(), 0
        for c in chunks:
            if not c.samples:
                continue
            n = 1 + len(c.draft)
            if c.draft:
                rows.drafted.append((c, at))
            else:
                rows.plain.append(c.request)
                rows.plain_rows.append(at)
            rows.counts[id(c.request)] = n
            rows.order.append(c.request)
            at += n
        return rows

    def plain_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The plain rows' logits: all of them (no copy) when nothing was drafted."""
        if not self.drafted:
            return logits
        return logits[torch.tensor(self.plain_rows, dtype=torch.long, device=logits.device)]


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposed = 0  # draft tokens scheduled for verification
        self.accepted = 0  # of which the verification kept: each a forward pass saved

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def propose(self, running: list[Request]) -> None:
        """Sets `draft` on every running request about to decode (cleared on the others)."""
        cfg = self.config
        crowded = cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size
        for req in running:
            req.draft = []
            if crowded or req.num_uncomputed_tokens != 1 or req.kv_state is not None:
                continue
            limit = req.context_limit or self.max_model_len
            room = min(
                req.draft_room or cfg.num_speculative_tokens,
                req.params.max_tokens - req.num_output_tokens - 1,  # the bonus token's place
                limit - req.num_tokens - 1,
            )
            if room < 1:
                continue
            draft = ngram_draft(req.token_ids, cfg.prompt_lookup_min, cfg.prompt_lookup_max, room)
            req.draft = _grammatical(req, draft)

    def verify(self, rows: SampleRows, logits: torch.Tensor, step: DraftStep) -> list[Request]:
        """Walks each drafted request's rows in order (see the module's doc); returns them."""
        out = []
        for chunk, first in rows.drafted:
            req = chunk.request
            if req.finished:  # failed earlier in this step
                continue
            self.proposed += len(chunk.draft)
            req.metrics.num_draft_tokens += len(chunk.draft)
            own = logits[first : first + 1 + len(chunk.draft)]
            kept = 0  # stays 0 when the walk fails the request (the boundary ends it alone)
            with step.boundary.request(req) as stage:
                kept = self._walk(req, chunk.draft, own, step, stage)
            self.accepted += kept
            req.metrics.num_accepted_draft_tokens += kept
            if self.config.draft_length == "adaptive":
                cap = self.config.num_speculative_tokens
                grown = min(cap, max(req.draft_room or cap, 2 * len(chunk.draft)))
                req.draft_room = grown if kept == len(chunk.draft) else kept + 1
            out.append(req)
        return out

    @staticmethod
    def _walk(
        req: Request, draft: Sequence[int], rows: torch.Tensor, step: DraftStep, stage: Stage
    ) -> int:
        """Draft tokens kept: each one the walk sampled itself, whose computed key and value are
        then counted in (`num_computed_tokens`)."""
        kept = 0
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.perf_counter()
        for j in range(len(draft) + 1):
            row = rows[j : j + 1]
            logits_processors.apply(row, [req])
            if req.grammar is not None and not step.mask(req, row):
                return kept
            stage("sample")
            proposed = draft[j] if j < len(draft) else None
            before = req.num_tokens
            step.take(req, step.verify(row, req, proposed), 0, stage)
            if proposed is None or req.num_tokens <= before or req.token_ids[before] != proposed:
                return kept
            req.num_computed_tokens += 1  # the draft token's key and value are now its own
            kept += 1
            if req.finished or req.num_tokens != before + 1:  # ended, or jump-forward moved on
                return kept
        return kept  # pragma: no cover - the last row has no draft token: returned above


@dataclass(frozen=True)
class DraftStep:
    """What verifying drafts needs of the engine's step, and nothing more: its failure
    boundary, one row's grammar mask (False: the mask failed the request), the sampler's
    `verify`, and the per-token path every sampled token takes (`TokenPath.take`)."""

    boundary: Boundary
    mask: Callable[[Request, torch.Tensor], bool]
    verify: Callable[[torch.Tensor, Request, int | None], Sampled]
    take: Callable[[Request, Sampled, int, Stage], None]


def _grammatical(req: Request, draft: list[int]) -> list[int]:
    """The draft up to the first token the request's grammar refuses; the matcher is left as
    it was."""
    state = req.grammar
    if state is None or not draft or state.is_terminated():
        return draft
    taken = 0
    for token in draft:
        try:
            if state.is_terminated() or not state.accept_token(token):
                break
        except GrammarError:  # past llguidance's limits: decoding meets it, not the draft
            break
        taken += 1
    if taken:
        state.rollback(taken)
    return draft[:taken]
