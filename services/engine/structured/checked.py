"""Checked decoding: a JSON output that fails its check goes back to the value that failed.

A grammar cannot enforce every keyword (`not`, `uniqueItems`, `if`/`then`/`else`, `oneOf`'s
exclusivity, ...: the fidelity report in `warnings` names them), and every finished JSON output
is checked against its whole schema (validation.py). When the check fails, the value it names is
where the output went wrong. While the request has retries left (`check_retries`), it goes back
to the token where that value starts: its later tokens are dropped, its grammar replayed up to
there, its keys and values recomputed as after a preemption (the prefix cache holds the prompt),
and the first token of the value that chose something (past its quote or bracket, which the
grammar forces) is excluded at its position, so it samples another there (a second return to the
same place excludes one more). When the retries are spent, or nothing
is left to sample there, it ends `error` (422) with the check's message: the keyword and path.

A sent token cannot be taken back, so a request that may go back (its grammar leaves a keyword
to the check) streams nothing until its output has passed; the others stream as before and are
not retried (their check fails only where a backend falls short of its report).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.request import Request, RequestStatus
from services.grammar.backend import GrammarState
from services.sandbox.validate import Located

_WHITESPACE = " \t\n\r"
_PUNCTUATION = _WHITESPACE + '{}[]:,"'
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class Rollback:
    """Go back to output token `keep` (the tokens before it stay) and exclude `token` there."""

    keep: int
    token: int


def by_check(warnings: list[str]) -> list[str]:
    """The fidelity report of a checked request: what its grammar leaves, the check enforces."""
    out = []
    for w in warnings:
        if w.endswith(": not enforced"):
            out.append(w.removesuffix("not enforced") + "enforced by the check, not the grammar")
        else:
            out.append(f"{w} (enforced by the check, not the grammar)")
    return out


def value_start(text: str, at: list[str | int]) -> int | None:
    """Where the value at path `at` starts in the JSON `text` (None: not found)."""
    i = _skip(text, 0)
    for step in at:
        if i >= len(text) or text[i] not in "{[":
            return None
        found = _member(text, i, step) if text[i] == "{" else _item(text, i, step)
        if found is None:
            return None
        i = found
    return i


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _member(text: str, i: int, name: str | int) -> int | None:
    """The start of member `name`'s value in the object at `i` (its last, as `json.loads`)."""
    found, i = None, _skip(text, i + 1)
    while i < len(text) and text[i] == '"':
        key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
        i = _skip(text, i)
        if text[i : i + 1] != ":":
            return None
        i = _skip(text, i + 1)
        if key == str(name):
            found = i
        after = _after_value(text, i)
        if after is None:
            return found
        i = after
    return found


def _item(text: str, i: int, index: str | int) -> int | None:
    if not isinstance(index, int):
        return None
    i = _skip(text, i + 1)
    for _ in range(index):
        after = _after_value(text, i)
        if after is None:
            return None
        i = after
    return i if i < len(text) and text[i] not in "]" else None


def _after_value(text: str, i: int) -> int | None:
    """Past the value at `i` and its separator: the next member or item (None at the end)."""
    try:
        _, end = _decoder.raw_decode(text, i)
    except ValueError:
        return None
    end = _skip(text, end)
    if text[end : end + 1] != ",":
        return None
    return _skip(text, end + 1)


def rollback_point(
    tokenizer: Any, prompt: list[int], output: list[int], text: str, start: int
) -> Rollback | None:
    """The output token whose text holds character `start` of `text` (the detokenizer's text
    of `output`), as a rollback there; None when no such token exists."""
    detok = IncrementalDetokenizer(tokenizer, prompt, ())
    for k, token in enumerate(output):
        detok.add_tokens([token])
        if len(detok.text) > start:
            if detok.text[:start] != text[:start]:
                return None
            # the value's punctuation (a quote, a bracket) is all the grammar allows there:
            # what is excluded is the first token that chose something
            for j in range(k, len(output)):
                if tokenizer.decode([output[j]]).strip(_PUNCTUATION):
                    return Rollback(j, output[j])
            return None
    return None


@torch.inference_mode()  # the forward's logits are inference tensors: written in place here
def exclude(excluded: dict[int, set[int]], position: int, row: torch.Tensor) -> bool:
    """Masks the tokens excluded at `position` in `row` [V] (after the grammar's mask); False
    when nothing is left to sample there."""
    tokens = excluded.get(position)
    if not tokens:
        return True
    row[list(tokens)] = float("-inf")
    return bool(torch.isfinite(row).any())


def going_back(req: Request, located: Located, retries: int, tokenizer: Any) -> Rollback | None:
    """Where a checked request whose output failed its check goes back to; None when it
    ends instead (not checked, out of retries, or the failing value cannot be found)."""
    s = req.structured
    _, _, at = located
    if s is None or not s.checked or s.retries >= retries or at is None:
        return None
    text = req.detokenizer.text
    start = value_start(text, at)
    if start is None:
        return None
    return rollback_point(tokenizer, req.prompt_token_ids, req.output_token_ids, text, start)


def rewind(req: Request, back: Rollback, new_state: Callable[[], GrammarState]) -> None:
    """Puts a finished request back to output token `back.keep`, waiting to be scheduled: its
    keys and values are recomputed (as after a preemption), its grammar replayed."""
    s = req.structured
    assert s is not None
    kept = req.output_token_ids[: back.keep]
    del req.token_ids[req.num_prompt_tokens + back.keep :]
    if req.logprobs is not None:
        del req.logprobs[back.keep :]
    for position in [p for p in s.excluded if p > back.keep]:  # made in another context
        del s.excluded[position]
    s.excluded.setdefault(back.keep, set()).add(back.token)
    s.retries += 1
    s.state = new_state()
    for token in kept:
        s.state.accept_token(token)
    s.whitespace_run, s.parked = 0, None
    req.detokenizer = req.detokenizer.rewound(kept)
    req.num_computed_tokens, req.pages, req.keyed_pages = 0, [], 0
    req.page_keys.clear()  # made again from the tokens as pages fill
    req.draft, req.prompt_logprobs = [], None
    if req.kv_state is not None:
        req.kv_state.evicted = req.kv_state.compactions = 0
    req.status, req.finish_reason = RequestStatus.WAITING, None
    req.validated = req.error_status = None
    req.metrics.finished_time = None
