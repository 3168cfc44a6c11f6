"""OpenAI-compatible request and response bodies, and their translation to engine parameters.

Bodies are validated with pydantic: a wrong type or an unknown value is a 400 naming the field. The
extensions follow vLLM where one exists: `structured_outputs` (json, regex, choice, grammar,
structural_tag), plus `grammar_id` (a registered grammar) and `kv_policy`.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from kvcache.policy_spec import KV_KINDS
from services.engine.chat_template import check_variables, reserved_names
from services.engine.params import MAX_TOP_K

# JSON's own types only: `true` is not the integer 1, nor `1` the boolean true (pydantic's lax mode
# takes both, so `max_tokens: true` meant one token)
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]


class _Body(BaseModel):
    # Unknown fields are ignored, as the OpenAI API does for forward compatibility; fields we
    # know but do not support are refused explicitly below.
    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Body):
    """`structural_tag`: xgrammar's `format` object, or vLLM's older `structures` + `triggers`."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        if self.type == "structural_tag" and (self.format is None) == (self.structures is None):
            raise ValueError("response_format: a structural_tag needs format, or structures")
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    grammar_id: str | None = None
    whitespace_pattern: str | None = None  # refused: xgrammar takes no whitespace regex
    disable_any_whitespace: Bool = False  # compact JSON
    disable_additional_properties: Bool = False
    # ours: outputs that finish (services/grammar/finish.py); set to turn them off
    bound_numbers: Bool = True
    max_repeat_run: Int | None = Field(default=128, ge=8)
    # ours: pins a grammar backend (else the service's `grammar_backend`)
    backend: Literal["xgrammar", "llguidance"] | None = None


class KVPolicyBody(_Body):
    model_config = ConfigDict(extra="forbid")

    # a registered policy (kvcache.policies.POLICIES); the schema still lists them
    kind: str = Field(default="full", json_schema_extra={"enum": list(KV_KINDS)})
    budget_tokens: Int | None = Field(default=None, ge=1, le=1 << 24)
    page_size: Int | None = Field(default=None, ge=1, le=1 << 16)
    offload: Bool = False
    window: Int | None = Field(default=None, ge=1, le=1 << 24)
    n_sink: Int = Field(default=4, ge=0, le=1 << 16)
    rerotate: Bool = False
    heavy_ratio: float = Field(default=0.5, ge=0, le=1)
    kernel_size: Int = Field(default=5, ge=1, le=255)
    dense_layers: Int = Field(default=2, ge=0, le=1024)
    # offload: pool pages of the hot set; a cache the scheduler takes back before preempting
    hot_pages: Int | None = Field(default=None, ge=0, le=1 << 20)

    @field_validator("kind")
    @classmethod
    def _registered(cls, kind: str) -> str:
        if kind not in KV_KINDS:
            raise ValueError(f"{kind!r} is not one of {', '.join(KV_KINDS)}")
        return kind


class StreamOptions(_Body):
    include_usage: Bool = False


# Fields a client may send that change nothing in the output: accepted and not used. Any other
# field the bodies below do not declare is refused with a 400 naming it (never silently dropped).
HARMLESS_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
)
MAX_TOP_LOGPROBS = 20


class _Common(_Body):
    model_config = ConfigDict(extra="allow")  # checked by `_known_fields`

    model: str
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: Int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: Int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    # sampling controls, with vLLM's names and bounds (SamplingParams says what each does)
    top_k: Int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(default=0.0, ge=0, le=1)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI sends it) -> bias
    min_tokens: Int = Field(default=0, ge=0)
    stop_token_ids: list[Int] | None = None
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=0)  # each prompt token's own
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar_id: str | None = None
    kv_policy: KVPolicyBody | None = None
    ignore_eos: Bool = False  # vLLM's extension: generate max_tokens even past end-of-sequence
    # vLLM's field: only requests with the same salt share cached prefix pages (within a tenant;
    # tenants never share any)
    cache_salt: str | None = None
    # older vLLM clients and SGLang's: aliases of `structured_outputs` (structured_fields.py)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @model_validator(mode="after")
    def _known_fields(self) -> _Common:
        unknown = sorted(set(self.model_extra or {}) - HARMLESS_FIELDS)
        if unknown:
            raise ValueError(f"{unknown[0]}: not supported by this server (remove it)")
        return self

    def logprobs_wanted(self) -> int | None:
        """How many top alternatives per output token (None: no log-probabilities)."""
        raise NotImplementedError


# OpenAI's limit on function names; plain names also keep the call's text free of escapes
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_TOOLS = 128


class FunctionDef(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: Bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Body):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCallIn(_Body):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


_RESERVED = reserved_names()


def template_options(body: Any) -> dict[str, Any]:
    """The chat template's keywords from a body (chat or /tokenize); `BadRequest` naming a
    `chat_template_kwargs` entry that is not a plain template variable (chat_template.py)."""
    try:
        variables = check_variables(body.chat_template_kwargs, _RESERVED)
    except ValueError as exc:
        raise BadRequest(str(exc), str(exc).split(":")[0]) from exc
    return {
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        **variables,
    }


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this answers

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text":
                    raise ValueError(f"{part.get('type')!r} content parts are not supported")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"messages.content: {kind!r} parts are not supported")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Common):
    """Tools: `tool_choice` defaults to `"auto"` with tools, else `"none"` (deployments/tools.py
    says what each choice constrains)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: thinking ends (its closing marker forced) after this many tokens; false: the
    # thinking is left out of the answer (it is still generated)
    thinking_token_budget: Int | None = None
    include_reasoning: Bool = True

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: there are no tools to choose from")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions share a name")
        named = self.tool_choice
        if isinstance(named, NamedToolChoice) and named.function.name not in names:
            raise ValueError(f"tool_choice: no function named {named.function.name!r} in tools")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt (set it "
                "to false)"
            )
        return self

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[Int] | list[str] = Field(min_length=1)
    echo: Bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _single(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported")
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], str)
        if batch and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request (a string or a list of token ids)")
        return self


class TokenizeRequest(_Body):
    """vLLM's `/tokenize`: a prompt, or chat messages through the template."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model_config = ConfigDict(extra="forbid")

    model: str
    tokens: list[Int] = Field(max_length=1 << 20)


class BadRequest(ValueError):
    """A 400 naming the offending field (`param`), in the OpenAI error shape."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def body_message(message: str) -> str:
    """An engine message names the Python field (`kv.budget_tokens: ...`); the HTTP body's is
    `kv_policy` (the field before the colon becomes the error's `param`)."""
    return "kv_policy." + message.removeprefix("kv.") if message.startswith("kv.") else message


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def client_request_id(headers: Any) -> str | None:
    """The client's `X-Request-Id`, when it is a plain short token (anything else is ignored:
    it ends up in logs and span attributes)."""
    value = headers.get("x-request-id")
    return value if value is not None and _REQUEST_ID.match(value) else None


def new_id(prefix: str, client_id: str | None = None) -> str:
    """The response id: the client's `X-Request-Id` after the prefix, as vLLM does, else a new
    one. Engine ids add a suffix of their own, so two requests sharing a client id never clash."""
    return f"{prefix}-{client_id}" if client_id else f"{prefix}-{uuid.uuid4().hex[:24]}"


def engine_id(response_id: str, choice: int) -> str:
    """The engine's id for one choice: unique even when clients reuse an `X-Request-Id`."""
    return f"{response_id}-{choice}-{uuid.uuid4().hex[:8]}"


def now() -> int:
    return int(time.time())
