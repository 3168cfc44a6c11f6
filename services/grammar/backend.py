"""The grammar-backend interface the engine uses, in the shape of vLLM's structured output.

A backend compiles a `StructuredOutput` once; each request then holds a `GrammarState` that accepts
tokens, fills its row of the next-token bitmask, rolls back, and says when it has terminated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import xgrammar as xgr

from services.grammar.structured import StructuredOutput


class GrammarError(ValueError):
    """The grammar cannot be used; the message names the field.

    `reason`: invalid | limit | fidelity | timeout | slow_mask | memory | crash | busy | not_found;
    `status`: the HTTP status an ingress answers with (400, 404, 422 or 429).
    """

    def __init__(self, message: str, reason: str = "invalid", status: int = 400) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status

    def __reduce__(self) -> tuple[type, tuple[str, str, int]]:  # crosses process boundaries
        return (type(self), (str(self), self.reason, self.status))


# The mask budget: a grammar whose probe masks take longer is refused at admission, and one whose
# masks run over it while decoding fails its request. One default for every config that holds it.
MASK_BUDGET_MS = 20.0
# How long past the start of a step's fills (and never before its forward ends) a step waits for
# one request's mask before that request leaves the step; a fill within the budget is in by then.
MASK_DEADLINE_MS = 20.0

MAX_JSON_TEXT_DEPTH = 128  # past the grammar limits' 64: those name the limit, this only guards


def load_json_text(text: str, field: str) -> Any:
    """A JSON document sent as a string (vLLM's clients send schemas and tags so), or a
    `GrammarError` naming `field`: not JSON, nested past `MAX_JSON_TEXT_DEPTH` (every later walk
    of it recurses), or holding a lone surrogate escape (`"\\ud800"`: no UTF-8 encoder takes it,
    so every later step would fail on it)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise GrammarError(f"{field}: not valid JSON ({str(exc)[:100]})") from exc
    stack, deepest = [(value, 1)], 0
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_TEXT_DEPTH:
            raise GrammarError(f"{field}: nested deeper than {MAX_JSON_TEXT_DEPTH} levels")
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, depth + 1) for child in children)
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        bad = f"\\u{ord(exc.object[exc.start]):04x}"
        raise GrammarError(f"{field}: holds a lone surrogate ({bad}), which is not text") from exc
    return value


@dataclass
class CompiledGrammar:
    """What a backend compiled, plus what it could not enforce."""

    handle: Any
    warnings: list[str] = field(default_factory=list)
    schema: dict[str, Any] | None = None  # for validating JSON outputs after decoding
    # `schema` as JSON text, made on its first validation (structured/validation.py)
    schema_text: str | None = field(default=None, repr=False, compare=False)
    backend: str = "xgrammar"  # the backend whose handle this is (grammar/backends.py)


class GrammarState(Protocol):
    def accept_token(self, token_id: int) -> bool: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Fills `bitmask[row]`; False when every token is allowed (nothing to apply)."""
        ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def jump_forward(self) -> str:
        """The text the grammar forces next ('' when none)."""
        ...


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """The one bitmask layout every backend fills: int32 words, token `t` at bit `t % 32` of
    word `t // 32`. Needs no tokenizer, so no backend is built for it."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int
) -> None:
    """Masks `rows` of `logits` in place (xgrammar's kernel, which takes row indices)."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, spec: StructuredOutput) -> CompiledGrammar: ...

    def new_state(self, compiled: CompiledGrammar) -> GrammarState: ...

    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...

    def apply_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
    ) -> None: ...
