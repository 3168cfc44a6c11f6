"""Turns the last-position logits of each sampling row into a token.

Greedy rows take the argmax. Other rows are scaled by temperature, cut by top-k, top-p and min-p,
and drawn with the request's own generator when it has a seed (so a seeded request gives the same
tokens whatever else shares its batch), else with the engine's.

A row whose logits cannot be sampled (NaN, +inf, or nothing left after the grammar's mask) fails
alone: `torch.multinomial` raises for the whole batch on one bad row, so bad rows are found first,
replaced by a harmless stand-in and reported in `Sampled.failed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.engine.params import TokenLogprob
from services.engine.request import Request


@dataclass
class Sampled:
    tokens: list[int]
    failed: dict[int, str] = field(default_factory=dict)  # row -> why it could not be sampled
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # rows that asked for them


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [S, V]; top_k [S] (0 = off); top_p [S]. Masked entries become -inf."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    cut = ranks >= k
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p; the first always stays
    # (a top_p that rounds to 0 in float32 would otherwise drop it too).
    cut |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    cut[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below `min_p` x the row's largest (the largest stays)."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def usable_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S] bool: no NaN, no +inf, and at least one token allowed (-inf is a masked token).

    One pass: a row's maximum is NaN if any entry is, +inf if any is, -inf if all are."""
    return torch.isfinite(logits.amax(dim=-1))


def _logprobs(
    logits: torch.Tensor, requests: list[Request], out: torch.Tensor
) -> Callable[[list[int]], dict[int, TokenLogprob]] | None:
    """The sampled token's log-probability and the top ones, for the rows that ask, from the
    logits as the sampler received them (penalties and mask applied, no temperature yet): queued
    on the device now, read (given the sampled tokens) once those have been transferred."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return None
    lsm = torch.log_softmax(logits[rows], dim=-1)
    chosen = lsm.gather(1, out[rows][:, None])
    k = max(requests[i].params.logprobs or 0 for i in rows)
    top_v, top_i = lsm.topk(k, dim=-1) if k else (lsm[:, :0], lsm[:, :0])
    packed = torch.cat([chosen, top_v, top_i.to(lsm.dtype)], dim=1).double()

    def read(tokens: list[int]) -> dict[int, TokenLogprob]:
        result = {}
        for row, values in zip(rows, packed.tolist(), strict=True):
            n = requests[row].params.logprobs or 0
            top = tuple((int(values[1 + k + j]), values[1 + j]) for j in range(n))
            result[row] = TokenLogprob(tokens[row], values[0], top)
        return result

    return read


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> Sampled:
        logits = logits.float()
        # one pass for both: the greedy token (the first of equal maxima, as argmax) and each
        # row's maximum, which is NaN if any entry is, +inf if any is, -inf if all are
        best, out = logits.max(dim=-1)
        ok = torch.isfinite(best)
        failed: dict[int, str] = {}
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rows:
            self._sample_rows(logits, requests, rows, out, ok, failed)
        logprobs = _logprobs(logits, requests, out)  # before the transfer: computed on device
        tokens, usable = torch.stack([out, ok.long()]).tolist()  # one transfer from the device
        for i, good in enumerate(usable):
            if not good:
                failed[i] = "sampling: the logits are not finite or no token is left to sample"
        return Sampled(tokens, failed, logprobs(tokens) if logprobs is not None else {})

    def verify(self, logits: torch.Tensor, req: Request, draft: int | None) -> Sampled:
        """One position of a speculative walk (`speculative.py`): `logits` [1, V] for `req`.
        Greedy, or no draft token here: what `__call__` draws. Sampling against a draft token:
        `accept_or_resample`, which leaves the output distribution as it was."""
        if draft is None or req.params.greedy:
            return self(logits, [req])
        logits = logits.float()
        if not bool(usable_rows(logits)[0]):
            return Sampled([0], {0: "sampling: the logits are not finite or no token is left"})
        probs, drawable = _probabilities(logits, [req])
        if not bool(drawable[0]):
            return Sampled([0], {0: "sampling: no token is left to sample"})
        token = accept_or_resample(probs[0], draft, req.generator or self.generator)
        chosen = torch.tensor([token], device=logits.device)
        read = _logprobs(logits, [req], chosen)
        return Sampled([token], {}, read([token]) if read is not None else {})

    def _sample_rows(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        rows: list[int],
        out: torch.Tensor,
        ok: torch.Tensor,
        failed: dict[int, str],
    ) -> None:
        picked = logits[rows]
        # a stand-in for unusable rows, so that nothing below raises for the whole draw
        picked = torch.where(ok[rows][:, None], picked, torch.zeros_like(picked))
        probs, drawable = _probabilities(picked, [requests[i] for i in rows])
        # belt and braces: a row the cuts left unsamplable fails alone, never the whole draw
        probs = torch.where(drawable[:, None], probs, torch.ones_like(probs))
        ok[rows] &= drawable
        shared = [j for j, i in enumerate(rows) if requests[i].generator is None]
        if shared:
            drawn = torch.multinomial(probs[shared], 1, generator=self.generator).squeeze(-1)
            out[[rows[j] for j in shared]] = drawn
        for j, i in enumerate(rows):
            gen = requests[i].generator
            if gen is None:
                continue
            try:
                out[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
            except RuntimeError as exc:  # this request's generator (e.g. on another device)
                failed[i] = f"sampling: {exc}"[:300]


def _probabilities(
    logits: torch.Tensor, requests: list[Request]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, V] probabilities after temperature, min-p, top-k and top-p, and [S] whether each
    row can be drawn from."""
    params = [r.params for r in requests]
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)
    scaled = logits / temp[:, None]
    # vLLM's order: min-p on the tempered distribution, then top-k and top-p
    if any(p.min_p > 0 for p in params):
        scaled = _min_p(scaled, torch.tensor([p.min_p for p in params], device=dev))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    return probs, torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)


def accept_or_resample(probs: torch.Tensor, draft: int, generator: torch.Generator) -> int:
    """Speculative sampling against a draft that proposed one token with certainty (prompt
    lookup): keep `draft` with probability p(draft), else draw from p without it, renormalized.
    Every token x then comes out with probability p(x): p(draft) directly, and any other x with
    (1 - p(draft)) * p(x) / (1 - p(draft)). `probs` [V]."""
    p_draft = probs[draft]
    if torch.rand((), generator=generator, device=probs.device) < p_draft:
        return draft
    rest = probs.clone()
    rest[draft] = 0.0
    if not bool(rest.sum() > 0):  # p(draft) == 1 up to rounding: nothing else to draw
        return draft
    return int(torch.multinomial(rest, 1, generator=generator)[0])
