"""Tool calling and thinking over HTTP: what the ingress checks, and the answer read back.

The replica holds each chat answer to one structural tag in the served model's dialect
(services/engine/chat.py `shape`: an optional thinking block, then calls as `tool_choice` asks,
or the response format, or text) and tells the ingress that tag; `AnswerReader` walks the same
tag to split the text into `reasoning_content`, `content` and `tool_calls`, streamed or whole
(the same message either way). What each `tool_choice` means:
- `"none"`: no tools in the prompt, nothing constrained (the model cannot call);
- `"auto"`: text until the model writes its dialect's call opener, from there the call is
  constrained; with `parallel_tool_calls=false` the answer ends after one call;
- `"required"`: calls only, one or more (one when not parallel); a named function: one call.
A tool with `strict: false` has its arguments parsed, not constrained. Every call's arguments
are validated against its function's schema after the fact, like `response_format`'s output.
A call is sent only once whole: one the answer ended inside (`max_tokens`) is left out and named
in the warnings, never sent in part. A call identical to an earlier one of the same answer (a
small model's loop) is dropped and ends it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from deployments.protocol import ChatCompletionRequest, NamedToolChoice
from services.dialects import Answer, Splitter
from services.engine.tool_format import END, TRIGGER, call_begin
from services.grammar.finish import bounded
from services.sandbox.validate import SchemaValidator, schema_text

VALIDATE_TIMEOUT_S = 1.0


def choice_of(body: ChatCompletionRequest) -> str:
    """`none`, `auto`, `required`, or `function` (a named one)."""
    if not body.tools:
        return "none"
    choice = body.tool_choice or "auto"
    return "function" if isinstance(choice, NamedToolChoice) else choice


def calls_expected(body: ChatCompletionRequest) -> bool:
    return choice_of(body) != "none"


def _schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters is not None else {"type": "object", "properties": {}}


def _constrained(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """What the arguments are held to: the schema, with its numbers bounded
    (services/grammar/finish.py)."""
    return bounded(_schema(parameters))


def structural_tag(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The calls' constraint in our own format (None for `"none"`): what the ingress screens
    against the grammar limits before the replica holds the answer to the dialect's."""
    choice = choice_of(body)
    if choice == "none":
        return None
    tools = [t.function for t in body.tools or ()]
    if isinstance(body.tool_choice, NamedToolChoice):
        tools = [f for f in tools if f.name == body.tool_choice.function.name]
    tags = [
        {
            "type": "tag",
            "begin": call_begin(f.name),
            "content": {"type": "json_schema", "json_schema": _constrained(f.parameters)},
            "end": END,
        }
        for f in tools
    ]
    # A named function is called once (vLLM's and OpenAI's behaviour), whatever parallel says
    one = not body.parallel_tool_calls or choice == "function"
    fmt: dict[str, Any]
    if choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [TRIGGER], "tags": tags}
        fmt |= {"at_least_one": False, "stop_after_first": one}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n"}
        fmt |= {"at_least_one": True, "stop_after_first": one}
    return {"type": "structural_tag", "format": fmt}


def answer_of(body: ChatCompletionRequest) -> dict[str, Any]:
    """What the replica shapes a chat answer by (replica.py `generate`)."""
    choice: Any = body.tool_choice if calls_expected(body) else "none"
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump()
    return {"tool_choice": choice or "auto", "parallel": body.parallel_tool_calls}


def prompt_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template sees (none for `"none"`: the model is not to call them)."""
    if not calls_expected(body):
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools or ()]


def messages_of(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation in the shape chat templates read (Hugging Face's: arguments as
    objects); raises ValueError naming an earlier call whose arguments are not JSON."""
    out = []
    for i, m in enumerate(body.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except (ValueError, RecursionError) as exc:
                    where = f"messages.{i}.tool_calls.{j}.function.arguments"
                    raise ValueError(f"{where}: not JSON ({exc})") from exc
                fn = {"name": call.function.name, "arguments": arguments}
                calls.append({"id": call.id, "type": "function", "function": fn})
            message["tool_calls"] = calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass
class AnswerReader:
    """Reads a choice's answer as it streams, by walking the structural tag that held it
    (services/dialects: `Splitter`): `feed` returns OpenAI chat deltas, `reasoning_content`
    (and `reasoning`, newer clients' name) unless `reasoning` is off, `content`, and each call
    whole, once its end is written (`tool_calls` entries with `index`, `id`, name and
    arguments). What the deltas add up to is what `result` gives for the whole answer."""

    tag: dict[str, Any]
    names: list[str]
    reasoning: bool = True  # include_reasoning
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    thinking: str = ""
    thinking_tokens: int = 0  # tokens of the deltas that wrote thinking
    repeated: bool = False  # the model called again exactly as before: the answer ends there
    cut: list[str] = field(default_factory=list)  # calls the text ended inside: left out
    _splitter: Splitter | None = None

    def __post_init__(self) -> None:
        self._splitter = Splitter(self.tag, self.names)

    def feed(self, text: str, tokens: int = 0) -> list[dict[str, Any]]:
        if self.repeated or self._splitter is None:
            return []
        new = self._splitter.feed(text)
        if new.reasoning:
            self.thinking_tokens += tokens
        return self._deltas(new)

    def finish(self) -> list[dict[str, Any]]:
        """The rest; a call the text ended inside is dropped (named in `cut`)."""
        if self.repeated or self._splitter is None:
            return []
        new = self._splitter.finish()
        self.cut, self._splitter = list(new.cut), None
        return self._deltas(new)

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """Once the text is all fed: the content (None when empty) and the calls."""
        self.finish()
        return (self.content or None), self.calls

    def _deltas(self, new: Answer) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if new.reasoning:
            self.thinking += new.reasoning
            if self.reasoning:
                out.append({"reasoning_content": new.reasoning, "reasoning": new.reasoning})
        if new.content:
            self.content += new.content
            out.append({"content": new.content})
        for call in new.calls:
            made = ToolCall(f"call_{uuid.uuid4().hex[:24]}", call.name, call.arguments)
            if any(_same(made, c) for c in self.calls):  # a small model's loop: end here
                self.repeated = True
                break
            self.calls.append(made)
            entry = {"index": len(self.calls) - 1, "id": made.id, "type": "function"}
            fn = {"name": made.name, "arguments": made.arguments}
            out.append({"tool_calls": [{**entry, "function": fn}]})
        return out


def _same(a: ToolCall, b: ToolCall) -> bool:
    if a.name != b.name:
        return False
    try:
        return bool(json.loads(a.arguments) == json.loads(b.arguments))
    except (ValueError, RecursionError):
        return a.arguments == b.arguments


def cut_warnings(reader: AnswerReader) -> list[str]:
    return [
        f"tool_calls: the answer ended inside {_called(name)} (max_tokens); it was left out"
        for name in reader.cut
    ]


def _called(name: str) -> str:
    return "a call" if name in ("", "a call") else f"a call of {name}"


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's `tool_calls` when the answer ended by itself after calling."""
    return "tool_calls" if calls and reason == "stop" else reason


async def validate(
    body: ChatCompletionRequest,
    calls: list[ToolCall],
    tenant: str = "default",
    content: tuple[dict[str, Any], str] | None = None,
) -> tuple[bool | None, list[str]]:
    """Each call's arguments against its function's `parameters`, and `content` (a response
    format's schema after thinking, and the answer's content) against its schema, in a killable
    worker under a time bound (the schema is the tenant's: services/sandbox/validate.py says why
    a thread would not do). None: there was nothing to check."""
    schemas = {t.function.name: _schema(t.function.parameters) for t in body.tools or ()}
    checks = [(schema_text(schemas.get(c.name, {})), c.arguments) for c in calls]
    where = [f"tool_calls[{c.name}]" for c in calls]
    if content is not None:
        checks.append((schema_text(content[0]), content[1]))
        where.append("content")
    if not checks:
        return None, []
    verdicts = await asyncio.to_thread(_validator().check, checks, tenant)
    problems = [
        f"{at}: "
        + (why or "").replace("output failed", "failed" if at == "content" else "arguments failed")
        for at, (ok, why) in zip(where, verdicts, strict=True)
        if not ok
    ]
    return not problems, [p[:300] for p in problems]


_VALIDATOR: list[SchemaValidator] = []  # this process's, made on first use


def _validator() -> SchemaValidator:
    if not _VALIDATOR:
        _VALIDATOR.append(SchemaValidator(workers=2, timeout_s=VALIDATE_TIMEOUT_S))
    return _VALIDATOR[0]
