"""The Responses API's request (`POST /v1/responses`), read into the chat request it means.

A response is one chat answer: `instructions` is the system message, `input` the conversation
(a string, or items: messages, `function_call` and `function_call_output` items, and
`reasoning` items, which a chat template does not re-render), `tools` the functions (the
Responses API's flat shape), `text.format` the response format, `reasoning.effort` a thinking
budget, `max_output_tokens` the limit. Nothing is stored (`store: true` and
`previous_response_id` are 400s naming them): a client sends the whole conversation, as the
OpenAI Agents SDK does by default.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from deployments.protocol import (
    FUNCTION_NAME,
    HARMLESS_FIELDS,
    MAX_TOOLS,
    BadRequest,
    Bool,
    ChatCompletionRequest,
    Int,
    _Body,
)

MAX_INPUT_ITEMS = 2048  # more is a 400 naming `input` (a conversation, not a data set)
# `reasoning.effort` as a thinking budget in tokens (None: the model thinks as long as it will)
EFFORT_BUDGET: dict[str, int | None] = {
    "none": 0,
    "minimal": 64,
    "low": 512,
    "medium": 2048,
    "high": None,
    "xhigh": None,
}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# what `include` may ask for; none of it changes the answer (no encrypted reasoning is kept)
INCLUDABLE = frozenset(
    {"reasoning.encrypted_content", "message.output_text.logprobs", "message.input_image.image_url"}
)


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a hint only


class ReasoningOptions(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries are written
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow")  # checked by `_known_fields`

    model: str
    input: str | list[dict[str, Any]] = Field(max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: Bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: Bool = False
    store: Bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    # ours and vLLM's, as on chat: the thinking's budget in tokens, and the template's options
    thinking_token_budget: Int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _known_fields(self) -> ResponsesRequest:
        unknown = sorted(set(self.model_extra or {}) - HARMLESS_FIELDS - {"prompt_cache_key"})
        if unknown:
            raise ValueError(f"{unknown[0]}: not supported by this server (remove it)")
        if self.store:
            raise ValueError("store: responses are not stored here; send store: false")
        if self.previous_response_id is not None:
            raise ValueError(
                "previous_response_id: responses are not stored here; send the whole "
                "conversation as `input`"
            )
        if bad := sorted(set(self.include or ()) - INCLUDABLE):
            raise ValueError(f"include: {bad[0]!r} is not supported")
        return self


def _text(content: Any, where: str) -> str:
    """A message's or an output's text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}: a string or a list of text parts", where)
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise BadRequest(f"{where}.{k}.type: {kind!r} parts are not supported", where)
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: consecutive `function_call` items are one assistant
    message's calls; each `function_call_output` is a tool message."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise BadRequest(f"{where}: an object", where)
        kind = item.get("type", "message")
        if kind not in ITEM_TYPES:
            known = ", ".join(ITEM_TYPES)
            raise BadRequest(f"{where}.type: unknown item type {str(kind)[:40]!r} ({known})", where)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role: user, system, developer or assistant", where)
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id") or item.get("id") or f"call_{i}"),
                "type": "function",
                "function": {
                    "name": item.get("name"),
                    "arguments": arguments_text(item.get("arguments", "{}")),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
        # reasoning items: a chat template does not re-render past thinking
    return out


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}


def _budget(body: ResponsesRequest) -> int | None:
    if body.thinking_token_budget is not None:
        return body.thinking_token_budget
    effort = body.reasoning.effort if body.reasoning is not None else None
    return EFFORT_BUDGET[effort] if effort is not None else None


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a response means; `BadRequest` naming the Responses field at fault."""
    choice: Any = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
        for t in body.tools or ()
    ]
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
        "response_format": _response_format(body),
        "thinking_token_budget": _budget(body),
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    if tools:
        chat |= {
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls,
        }
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        field = _RESPONSES_NAME.get(loc.split(".")[0], loc.split(".")[0])
        if ":" not in message:
            message = f"{field}: {message}"
        raise BadRequest(message, field) from exc


# a chat field's name in the Responses API, for errors
_RESPONSES_NAME = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tools": "tools",
}


def arguments_text(arguments: Any) -> str:
    """A function call item's arguments as the JSON text chat carries."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
