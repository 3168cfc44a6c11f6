"""What an LLM replica streams to the ingress: one `Delta` per step of a choice.

Small by design (no prompt ids, no whole text: the ingress adds the deltas up) and typed, so the
ingress reads fields, never a dict by string key. Ray pickles it across the handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from deployments.logprobs import TokenText, entries, prompt_entries
from services.engine.params import RequestOutput


@dataclass(frozen=True)
class Split:
    """How the ingress splits a chat answer (thinking, content, calls: tools.AnswerReader)."""

    tag: dict[str, Any]
    names: list[str]
    schema: Any  # a response format held after the thinking block, or None


@dataclass(frozen=True)
class Delta:
    delta_text: str = ""
    num_delta_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # so far
    warnings: list[str] = field(default_factory=list)  # on the last delta
    validated: bool | None = None
    error_status: int | None = None  # finish_reason "error": the HTTP status it maps to
    logprobs: list[Any] | None = None  # this delta's tokens' (deployments/logprobs.py)
    prompt_logprobs: list[Any] | None = None  # on the last delta
    answer: Split | None = None  # on the first delta of a chat answer that needs splitting

    @classmethod
    def of(cls, out: RequestOutput, text: TokenText) -> Delta:
        return cls(
            delta_text=out.delta_text,
            num_delta_tokens=len(out.delta_token_ids),
            finished=out.finished,
            finish_reason=out.finish_reason,
            prompt_tokens=len(out.prompt_token_ids),
            cached_tokens=out.metrics.num_cached_tokens,
            completion_tokens=len(out.token_ids),
            warnings=out.warnings if out.finished else [],
            validated=out.validated,
            error_status=out.error_status,
            logprobs=entries(out, text),
            prompt_logprobs=prompt_entries(out, text) if out.finished else None,
        )

    @classmethod
    def refusal(cls, message: str, status: int) -> Delta:
        """A request refused before the engine saw it, in the shape of a last delta."""
        return cls(finished=True, finish_reason="error", warnings=[message], error_status=status)

    def ended(self, message: str, status: int) -> Delta:
        """The last delta of a choice whose engine went down after this one."""
        end = Delta.refusal(message, status)
        return replace(
            end, prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens
        )
