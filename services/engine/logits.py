"""Logits processors: repetition, presence and frequency penalties, logit bias and min_tokens.

They change the sampling rows' logits in place after the forward pass and before the grammar's
mask (vLLM's order), batched: one scatter per kind for every row that asks, none for the rest.
The per-row work is only gathering the token ids each row already holds.

- `repetition_penalty` p (HF's and vLLM's): a token seen in the prompt or the output has its logit
  divided by p when positive, multiplied by p when negative;
- `presence_penalty` / `frequency_penalty` (OpenAI's): minus the penalty once for a token present
  in the output, minus the penalty times its count;
- `logit_bias`: added to the listed tokens;
- `min_tokens`: end-of-sequence and stop tokens are masked until that many tokens are out. A
  request with a grammar is left to its grammar: masking the end it forces would leave nothing;
- `thinking_token_budget`: a thinking block past its budget keeps only its closing marker's next
  token (services/engine/thinking.py).
"""

from __future__ import annotations

import torch

from services.engine import thinking
from services.engine.request import Request


@torch.inference_mode()  # the forward's logits are inference tensors: written in place here
def apply(logits: torch.Tensor, requests: list[Request]) -> None:
    """`logits` [S, V], row i for `requests[i]`."""
    penalized = [i for i, r in enumerate(requests) if r.params.penalized]
    if penalized:
        _penalties(logits, requests, penalized)
        _bias(logits, requests, penalized)
    _min_tokens(logits, requests)
    thinking.force(logits, requests)  # a thinking block past its budget closes


def _flat(rows: list[int], ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Row and token indices of every (row, id) pair, as two long tensors."""
    row_idx = [r for r, row_ids in zip(rows, ids, strict=True) for _ in row_ids]
    flat = [t for row_ids in ids for t in row_ids]
    return (
        torch.tensor(row_idx, dtype=torch.long, device=device),
        torch.tensor(flat, dtype=torch.long, device=device),
    )


def _penalties(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    dev, vocab = logits.device, logits.shape[-1]
    params = [requests[i].params for i in rows]
    repeat = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeat:
        rows_r = [rows[j] for j in repeat]
        seen = torch.zeros(len(logits), vocab, dtype=torch.bool, device=dev)
        seen[_flat(rows_r, [requests[i].token_ids for i in rows_r], dev)] = True
        penalty = torch.ones(len(logits), 1, device=dev, dtype=logits.dtype)
        penalty[rows_r, 0] = torch.tensor(
            [params[j].repetition_penalty for j in repeat], device=dev, dtype=logits.dtype
        )
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, scaled, logits))
    counted = [j for j, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if counted:
        rows_c = [rows[j] for j in counted]
        counts = torch.zeros(len(logits), vocab, dtype=logits.dtype, device=dev)
        index = _flat(rows_c, [requests[i].output_token_ids for i in rows_c], dev)
        counts.index_put_(index, torch.ones_like(index[0], dtype=logits.dtype), accumulate=True)
        presence = torch.zeros(len(logits), 1, device=dev, dtype=logits.dtype)
        frequency = torch.zeros_like(presence)
        presence[rows_c, 0] = torch.tensor(
            [params[j].presence_penalty for j in counted], device=dev, dtype=logits.dtype
        )
        frequency[rows_c, 0] = torch.tensor(
            [params[j].frequency_penalty for j in counted], device=dev, dtype=logits.dtype
        )
        logits -= frequency * counts + presence * (counts > 0)


def _bias(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    biased = [i for i in rows if requests[i].params.logit_bias]
    if not biased:
        return
    items = [list((requests[i].params.logit_bias or {}).items()) for i in biased]
    index = _flat(biased, [[t for t, _ in row] for row in items], logits.device)
    values = torch.tensor([v for row in items for _, v in row], device=logits.device)
    logits.index_put_(index, values.to(logits.dtype), accumulate=True)


def _min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    early = [
        i
        for i, r in enumerate(requests)
        if r.num_output_tokens < r.params.min_tokens and r.grammar is None
    ]
    if not early:
        return
    ends = [
        sorted(requests[i].eos_token_ids | set(requests[i].params.stop_token_ids or ()))
        for i in early
    ]
    logits[_flat(early, ends, logits.device)] = float("-inf")
