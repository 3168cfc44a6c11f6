"""The grammar-backend interface the engine uses, in the shape of vLLM's structured output.

A backend compiles a `StructuredOutput` once; each request then holds a `GrammarState` that accepts
tokens, fills its row of the next-token bitmask, rolls back, and says when it has terminated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import xgrammar as xgr

from services.engine.params import StructuredOutput


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


@dataclass
class CompiledGrammar:
    """What a backend compiled, plus what it could not enforce."""

    handle: Any
    warnings: list[str] = field(default_factory=list)
    schema: dict[str, Any] | None = None  # for validating JSON outputs after decoding
    # built from `schema` on first use (grammar/validation.py); the exception if it could not be
    validator: Any = field(default=None, repr=False, compare=False)
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
