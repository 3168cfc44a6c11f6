"""A thinking block held to its token budget (`SamplingParams.thinking_token_budget`, vLLM's
name): once the block has run that many tokens, its closing marker is written for it, one
token a step (every other token's logit masked), and the answer goes on under its grammar.

`LLM.chat` fills the block's markers in (`SamplingParams.thinking`, services/engine/chat.py);
the block is open from the start when the prompt opened it, else once the output opens it, and
done when the output closes it, by itself or forced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.params import Thinking

if TYPE_CHECKING:
    from services.engine.request import Request

_TAIL = 64  # characters of the output searched for a marker after each token


@dataclass(eq=False)
class ThinkingState:
    spec: Thinking
    budget: int
    inside: bool = False
    tokens: int = 0  # spent inside the block
    forcing: int = -1  # the next closing token to force; -1: none
    done: bool = False

    @classmethod
    def of(cls, spec: Thinking, budget: int) -> ThinkingState:
        state = cls(spec, budget, inside=spec.open_at_start)
        state._check_budget()
        return state

    def forced(self) -> int | None:
        """The token this step must sample, if any."""
        return self.spec.closer_ids[self.forcing] if self.forcing >= 0 else None

    def after(self, req: Request, new: list[int]) -> None:
        """Counts the tokens just appended and moves the state on."""
        if self.done:
            return
        text = req.detokenizer.text[-_TAIL:]
        for _ in new:
            if self.forcing >= 0:
                self.forcing += 1
                if self.forcing >= len(self.spec.closer_ids):
                    self.forcing, self.done = -1, True
                    return
            elif self.inside:
                self.tokens += 1
        if not self.inside and self.spec.opener in text:
            self.inside = True
        elif self.inside and self.forcing < 0 and self.spec.closer in text:
            self.done = True  # the model closed it itself
            return
        self._check_budget()

    def _check_budget(self) -> None:
        if self.inside and not self.done and self.forcing < 0 and self.tokens >= self.budget:
            self.forcing = 0


@torch.inference_mode()
def force(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rows whose thinking must close now keep only the closing token's logit (before the
    grammar's mask, which allows it: the block's end is where the grammar goes next)."""
    rows, tokens = [], []
    for i, r in enumerate(requests):
        token = r.thinking.forced() if r.thinking is not None else None
        if token is not None:
            rows.append(i)
            tokens.append(token)
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = float("-inf")
    logits[index, torch.tensor(tokens, device=logits.device)] = 0.0
