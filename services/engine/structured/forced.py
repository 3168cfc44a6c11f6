"""Jump-forward: where the grammar forces text, the sampled token and that text become a span of
tokens appended at once, saving a forward pass per token after the first.

The forced text is asked of the grammar on the mask workers under the mask deadline, like a mask:
when it is late, the token is accepted and the rest of its path waits, parked (late.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.engine.request import Request
from services.engine.structured.late import LateRows, Resume
from services.engine.structured.masks import MaskFiller


class JumpForward:
    def __init__(
        self,
        tokenizer: Any,
        masks: Callable[[], MaskFiller],
        late: LateRows,
        deadline_ms: float | None,
    ) -> None:
        self._tokenizer = tokenizer
        self._masks = masks  # the manager's filler (its workers), made on first use
        self._late = late
        self._deadline_ms = deadline_ms
        # read by telemetry (services/engine/stats.py); plain ints, written on the engine thread
        self.tokens = 0  # put in outputs by jump-forward, never sampled
        self.passes_saved = 0  # decode steps not run: one per forced token after the first

    def text(self, req: Request, then: Resume, stage: Callable[[str], None]) -> None:
        """Calls `then(text, stage)` with the text the grammar forces after the token it just
        accepted, at once when it is in by the mask deadline; else the request is parked and
        `then` runs in a later step (with that step's stage namer)."""
        state = req.grammar
        if state is None or state.is_terminated():
            then("", stage)
            return
        workers = self._masks().workers
        if workers is None or self._deadline_ms is None:
            then(state.jump_forward(), stage)
            return
        job = workers.submit([(state.jump_forward, req.tenant)])[0]
        if workers.wait([job], self._deadline_ms / 1000):
            if job.error is not None:
                raise job.error
            then(job.result, stage)
            return
        workers.straggle(job)
        self._late.park_forced(req, job, then)

    def span(self, req: Request, token: int, room: int, forced: str) -> list[int]:
        """The tokens to append for a just-accepted `token`: itself, or a canonical span over it.

        When the grammar forces text next (`forced`), `token` + that text is re-tokenized the way
        the tokenizer would write it; the matcher is rolled back where that changes `token` and
        fed the new tokens. The last token of the span stays open (the model samples it next,
        masked) because it could merge with what follows into a longer vocabulary token. `room`
        caps the span (max_tokens). The sampled token is not in the KV cache yet, so no cache
        rolls back.
        """
        state = req.grammar
        if state is None or not forced:
            return [token]
        head = self._tokenizer.decode([token])
        if "\ufffd" in head:  # part of a multi-byte character: re-encoding would not round-trip
            return [token]
        ids = list(self._tokenizer.encode(head + forced, add_special_tokens=False))[:-1][:room]
        if len(ids) <= 1:
            return [token]
        keep = 1 if ids[0] == token else 0
        if not keep:
            state.rollback(1)
        accepted = 0
        for t in ids[keep:]:
            if not state.accept_token(t):
                break
            accepted += 1
        if accepted < len(ids) - keep:  # the grammar disagrees with the tokenizer: undo it all
            state.rollback(accepted)
            if not keep:
                state.accept_token(token)
            return [token]
        req.metrics.num_forced_tokens += len(ids) - 1
        self.tokens += len(ids) - keep
        self.passes_saved += len(ids) - 1
        return ids
