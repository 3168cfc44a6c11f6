"""OpenAI-compatible request and response bodies, and their translation to engine parameters.

Bodies are validated with pydantic: a wrong type or an unknown value is a 400 naming the field. The
extensions follow vLLM where one exists: `structured_outputs` (json, regex, choice, grammar,
structural_tag), plus `grammar_id` (a registered grammar) and `kv_policy`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.engine.params import KVPolicy, SamplingParams, StructuredOutput


class _Body(BaseModel):
    # Unknown fields are ignored, as the OpenAI API does for forward compatibility; fields we
    # know but do not support are refused explicitly below.
    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    grammar_id: str | None = None
    whitespace_pattern: str | None = None  # accepted for vLLM compatibility, not used


class KVPolicyBody(_Body):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["full", "window", "sinks", "h2o", "snapkv", "quest"] = "full"
    budget_tokens: int | None = Field(default=None, ge=1, le=1 << 24)
    page_size: int | None = Field(default=None, ge=1, le=1 << 16)
    offload: bool = False
    window: int | None = Field(default=None, ge=1, le=1 << 24)
    n_sink: int = Field(default=4, ge=0, le=1 << 16)
    rerotate: bool = False
    heavy_ratio: float = Field(default=0.5, ge=0, le=1)
    kernel_size: int = Field(default=5, ge=1, le=255)
    dense_layers: int = Field(default=2, ge=0, le=1024)
    # offload: pool pages of the hot set; a cache the scheduler takes back before preempting
    hot_pages: int | None = Field(default=None, ge=0, le=1 << 20)


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool | int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar_id: str | None = None
    kv_policy: KVPolicyBody | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-sequence

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> _Common:
        if self.frequency_penalty or self.presence_penalty:
            raise ValueError("frequency_penalty and presence_penalty are not supported; use 0")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _no_tools(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools: not supported yet; use structured_outputs.structural_tag")
        return self


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: bool = False

    @model_validator(mode="after")
    def _single(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported")
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], str)
        if batch and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request (a string or a list of token ids)")
        return self


class BadRequest(ValueError):
    """A 400 naming the offending field (`param`), in the OpenAI error shape."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def structured_from(body: Any) -> StructuredOutput | None:
    """At most one of the body's `response_format` (json), `structured_outputs` and `grammar_id`
    (a completion request, or a grammar registration, which has no `grammar_id`)."""
    chosen: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        chosen.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        strict = rf.json_schema.strict is not False
        opts = {"json_schema": rf.json_schema.schema_, "strict": strict}
        chosen.append(("response_format", opts))
    so = body.structured_outputs
    if so is not None:
        kinds = {
            "json_schema": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "structural_tag": so.structural_tag,
            "grammar_id": so.grammar_id,
        }
        given = {k: v for k, v in kinds.items() if v is not None}
        if len(given) != 1:
            raise BadRequest(
                "structured_outputs: set exactly one of json, regex, choice, grammar, "
                "structural_tag, grammar_id",
                "structured_outputs",
            )
        chosen.append(("structured_outputs", given))
    grammar_id = getattr(body, "grammar_id", None)
    if grammar_id is not None:
        chosen.append(("grammar_id", {"grammar_id": grammar_id}))
    if not chosen:
        return None
    if len(chosen) > 1:
        names = ", ".join(name for name, _ in chosen)
        raise BadRequest(f"{names}: give one way of constraining the output", chosen[1][0])
    field, kwargs = chosen[0]
    if isinstance(kwargs.get("structural_tag"), str):
        import json

        try:
            kwargs["structural_tag"] = json.loads(kwargs["structural_tag"])
        except (json.JSONDecodeError, RecursionError) as exc:
            raise BadRequest(f"structural_tag: not valid JSON ({exc})", field) from exc
    try:
        return StructuredOutput(**kwargs)
    except ValueError as exc:
        raise BadRequest(str(exc), field) from exc


def sampling_from(body: _Common, max_tokens_cap: int, default_max_tokens: int) -> SamplingParams:
    requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
    max_tokens = requested or default_max_tokens
    if max_tokens > max_tokens_cap:
        raise BadRequest(
            f"max_tokens: {max_tokens} is above this tenant's limit of {max_tokens_cap}",
            "max_tokens",
        )
    kv = None
    if body.kv_policy is not None:
        try:
            kv = KVPolicy(**body.kv_policy.model_dump())
        except ValueError as exc:
            raise BadRequest(str(exc), "kv_policy") from exc
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop,
            ignore_eos=body.ignore_eos,
            structured=structured_from(body),
            kv=kv,
        )
    except BadRequest:
        raise
    except ValueError as exc:
        raise BadRequest(str(exc), str(exc).split(":")[0]) from exc


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
