"""Turns the last-position logits of each sampling row into a token.

Greedy rows take the argmax. Other rows are scaled by temperature, cut by top-k and top-p, and drawn
with the request's own generator when it has a seed (so a seeded request gives the same tokens
whatever else shares its batch), else with the engine's.
"""

from __future__ import annotations

import torch

from services.engine.request import Request


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [S, V]; top_k [S] (0 = off); top_p [S]. Masked entries become -inf."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    cut = ranks >= k
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (the first always stays).
    cut |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        logits = logits.float()
        out = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rows:
            self._sample_rows(logits, requests, rows, out)
        return out.tolist()

    def _sample_rows(
        self, logits: torch.Tensor, requests: list[Request], rows: list[int], out: torch.Tensor
    ) -> None:
        params = [requests[i].params for i in rows]
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev)
        scaled = logits[rows] / temp[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=dev)
            top_p = torch.tensor([p.top_p for p in params], device=dev)
            scaled = _top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        shared = [j for j, i in enumerate(rows) if requests[i].generator is None]
        if shared:
            drawn = torch.multinomial(probs[shared], 1, generator=self.generator).squeeze(-1)
            out[[rows[j] for j in shared]] = drawn
        for j, i in enumerate(rows):
            gen = requests[i].generator
            if gen is not None:
                out[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
