"""What a caller asks for (`SamplingParams`) and what it gets back (`RequestOutput`).

Frozen dataclasses inside the engine; the HTTP layer validates with pydantic and converts to these.
Invalid values raise `ValueError` naming the field, so a bad request fails before it is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

# KVPolicy lives beside the policies it names; this is its public place (`services.KVPolicy`).
from kvcache.policy_spec import KVPolicy as KVPolicy
from services.dialects import Call
from services.grammar.structured import StructuredOutput

FinishReason = Literal["stop", "length", "error", "abort"]

MAX_TOP_K = (1 << 31) - 1  # an int32 on the device; any value past the vocabulary is "off"


# Below this a temperature cannot be sampled stably (logits / t overflow): such a request is
# decoded greedily, as vLLM does.
SAMPLING_EPS = 1e-5
# Stop strings are matched incrementally (services/engine/detokenizer.py), but each one costs
# memory and a scan per new character: bounded like the rest of a request.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs bound
MAX_SALT_CHARS = 256
MAX_THINKING_BUDGET = 1 << 24  # above any context: max_tokens ends the request first
MAX_LOGIT_BIAS = 1024  # OpenAI has no bound; a dict this long is already a vocabulary slice
_SEED_RANGE = (-(2**63), 2**64)  # what a torch.Generator accepts


@dataclass(frozen=True)
class Thinking:
    """A thinking block's markers: open from the start when the prompt opened it."""

    open_at_start: bool
    opener: str
    closer: str
    closer_ids: tuple[int, ...]


@dataclass(frozen=True)
class SamplingParams:
    """`temperature` below `SAMPLING_EPS` (0 included) is greedy; `top_k` 0 or -1 and `top_p` 1
    and `min_p` 0 switch those cuts off (vLLM's conventions)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    # the log-probability of every prompt token after the first, given the tokens before it
    # (computed as the prompt is prefilled, through the request's KV policy)
    prompt_logprobs: bool = False
    structured: StructuredOutput | None = None
    kv: KVPolicy | None = None
    # Below, after the public positional order, vLLM's sampling controls with its bounds:
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability, in [0, 1]
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from every token in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    # > 0: logits of tokens in the prompt or the output are divided by it (multiplied when < 0)
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # no EOS, stop token or stop string ends the output before this many
    # the sampled token's log-probability and this many of the most likely ones (0..20)
    logprobs: int | None = None
    # max_tokens is only a cap: lowered to the context left after the prompt (an HTTP request
    # that did not set it, as in vLLM)
    fit_max_tokens: bool = False
    # keeps this request's cached prefix apart from the rest of its tenant's (vLLM's field):
    # only requests with the same salt share prefix pages (tenants never share any)
    cache_salt: str | None = None
    # the thinking block may run this many tokens, then its closing marker is written for it
    # and the answer goes on (vLLM's name; services/engine/thinking.py). `thinking`: the
    # block's markers, which `LLM.chat` fills in from the model's dialect
    thinking_token_budget: int | None = None
    thinking: Thinking | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        budget = self.thinking_token_budget
        if budget is not None and not 0 <= budget <= MAX_THINKING_BUDGET:
            raise ValueError(
                f"thinking_token_budget: must be in [0, {MAX_THINKING_BUDGET}], got {budget}"
            )
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            raise ValueError(f"temperature: must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(
                f"top_k: must be in [0, {MAX_TOP_K}], or -1 (0 and -1 disable it), got {self.top_k}"
            )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
            raise ValueError(f"seed: must be in [-2**63, 2**64), got {self.seed}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        self._check_controls()

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0 or math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        bias = dict(self.logit_bias or {})
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias: {token!r} is not a token id")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias: {value} for token {token} is not in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias or None)
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT_CHARS):
            raise ValueError(f"cache_salt: must be a string of 1 to {MAX_SALT_CHARS} characters")

    @property
    def penalized(self) -> bool:
        """True when a logits processor (services/engine/logits.py) has work for this request."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _stop_strings(stop: tuple[str, ...] | list[str] | str | None) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    stop = tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError("stop: every stop string must be a non-empty string")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"stop: at most {MAX_STOP_CHARS} characters a string, got {longest}")
    return stop


def _stop_token_ids(ids: tuple[int, ...] | list[int] | None) -> tuple[int, ...]:
    ids = tuple(ids or ())
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError("stop_token_ids: every id must be an integer >= 0")
    return ids


@dataclass
class RequestMetrics:
    """Per-request timings (seconds, `time.perf_counter` clock) and derived rates."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_forced_tokens: int = 0  # appended by jump-forward: each is a decode step saved
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    num_draft_tokens: int = 0  # speculative tokens proposed and verified
    num_accepted_draft_tokens: int = 0  # of which kept: each a forward pass saved

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tokens_per_second(self) -> float | None:
        if self.first_token_time is None or self.finished_time is None:
            return None
        decode_time = self.finished_time - self.first_token_time
        if self.num_output_tokens <= 1 or decode_time <= 0:
            return None
        return (self.num_output_tokens - 1) / decode_time

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "queue_time": self.queue_time,
            "time_to_first_token": self.time_to_first_token,
            "tokens_per_second": self.tokens_per_second,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_preemptions": self.num_preemptions,
            "num_forced_tokens": self.num_forced_tokens,
            "num_cached_tokens": self.num_cached_tokens,
        }


@dataclass
class RequestOutput:
    """The result of one request; in streaming, `delta_text`/`delta_token_ids` hold what is new."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    warnings: list[str] = field(default_factory=list)
    validated: bool | None = None  # JSON outputs: whether the text validated against the schema
    error_status: int | None = None  # finish_reason "error": 400 bad input, 404, 422, 429
    prompt_logprobs: list[float] | None = None  # SamplingParams.prompt_logprobs: tokens 1..n-1
    # SamplingParams.logprobs: one per output token (all of them: stream deltas slice it)
    logprobs: list[TokenLogprob] | None = None
    # `LLM.chat`'s answer split by its dialect (services/engine/chat.py): the thinking, the
    # rest of the text, and the whole calls (`name`, `arguments` as JSON text)
    reasoning_text: str | None = None
    content: str | None = None
    tool_calls: list[Call] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability and the most likely alternatives, from the logits the
    token was drawn from after penalties and the grammar's mask, before temperature and the
    top-k/top-p/min-p cuts (vLLM's processed-logits choice). A token jump-forward appended was
    forced by the grammar: 0.0, alone among its alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
