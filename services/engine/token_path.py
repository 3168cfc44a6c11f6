"""What one sampled token does to its request, the same for a plain decode step and for each
position of a verified draft (services/engine/speculative.py): a sampling failure fails the
request alone; else its grammar accepts the token (or jump-forward extends it into the span the
grammar forces), its logprobs are kept, its text grows and its stops are checked.
"""

from __future__ import annotations

from collections.abc import Callable

from services.engine.failures import RequestError
from services.engine.params import FinishReason, TokenLogprob
from services.engine.request import Request
from services.engine.sampler import Sampled
from services.engine.structured.manager import GrammarManager

Stage = Callable[[str], None]  # names the stage a request's work is in (failures.Boundary)


class TokenPath:
    def __init__(
        self,
        grammars: GrammarManager,
        jump_forward: bool,
        max_model_len: int,
        finish: Callable[[Request, FinishReason], None],
    ) -> None:
        self._grammars = grammars
        self._jump_forward = jump_forward
        self._max_model_len = max_model_len
        self._finish = finish

    def take(self, req: Request, sampled: Sampled, row: int, stage: Stage) -> None:
        """Row `row` of `sampled` into `req` (inside the request's failure boundary)."""
        stage("sample")
        if row in sampled.failed:
            raise RequestError(sampled.failed[row])
        self.advance(req, sampled.tokens[row], stage, sampled.logprobs.get(row))

    def advance(
        self, req: Request, token: int, stage: Stage, logprob: TokenLogprob | None = None
    ) -> None:
        """Appends one sampled token (or the span jump-forward makes of it) and checks stops.
        When the grammar's forced text misses the mask deadline, the token is accepted and the
        rest waits, parked, for a later step (structured/late.py)."""
        stage("accept")
        reason = self._grammars.accept(req, token)
        if reason is None and self._jump_forward:
            stage("jump_forward")

            def then(forced: str, stage: Stage) -> None:
                self._append(req, token, stage, logprob, None, forced)

            self._grammars.forced.text(req, then, stage)
            return
        self._append(req, token, stage, logprob, reason, "")

    def _append(
        self,
        req: Request,
        token: int,
        stage: Stage,
        logprob: TokenLogprob | None,
        reason: FinishReason | None,
        forced: str,
    ) -> None:
        new = [token]
        if forced:
            room = min(
                req.params.max_tokens - req.num_output_tokens,
                (req.context_limit or self._max_model_len) - req.num_tokens,
            )
            new = self._grammars.forced.span(req, token, room, forced)
        req.token_ids.extend(new)
        if logprob is not None:
            req.record_logprobs(logprob, new)
        stage("detokenize")  # stop strings are matched as the text grows
        req.detokenizer.add_tokens(new)
        if req.thinking is not None:  # its budget counts what the block holds
            req.thinking.after(req, new)
        stage("stop")
        reason = reason or self._stop_reason(req, new[-1])
        if reason:
            self._finish(req, reason)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        if token in req.eos_token_ids or token in (req.params.stop_token_ids or ()):
            return "stop"
        if req.detokenizer.stopped:
            return "stop"
        limit = req.context_limit or self._max_model_len
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= limit:
            return "length"
        return None
