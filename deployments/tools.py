"""Tool calling: what each `tool_choice` constrains, and the model's text back into `tool_calls`.

The calls are written in one format (`services.engine.tool_format`), constrained with an xgrammar
structural tag whose tags are `call_begin(name)` + the function's `parameters` + `END`:
- `"none"`: no tools in the prompt, nothing constrained, no parsing (the model cannot call);
- `"auto"`: free text until the model writes the trigger `<tool_call>`; from there the call is
  constrained (a triggered tag); with `parallel_tool_calls=false` the answer ends after one call;
- `"required"`: the answer is calls only, one or more (one when not parallel), so the arguments
  always parse and follow the schema; a named function: one call of it.
Arguments are sent as the model wrote them (a JSON object's text), streamed or whole, and
validated against the function's schema after the fact, like `response_format`'s output. A call
is sent only once whole: one the answer ended inside (`max_tokens`) is left out and named in
the warnings, never sent in part. A call identical to an earlier one of the same answer (a
small model's loop) is dropped and ends it.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from deployments.protocol import ChatCompletionRequest, NamedToolChoice
from services.engine.tool_format import END, TRIGGER, call_begin
from services.grammar.finish import bounded
from services.sandbox.validate import SchemaValidator, schema_text

_HEAD = re.compile(r'^\n\{"name": "([A-Za-z0-9_.-]{1,64})", "arguments": ')
_HEAD_MAX = 96  # the longest head `_HEAD` can match
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
    """The constraint for the body's `tool_choice` (None for `"none"`)."""
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


def _held(buffer: str, marker: str) -> int:
    """How many trailing characters of `buffer` could begin `marker` (kept back)."""
    for n in range(min(len(buffer), len(marker) - 1), 0, -1):
        if marker.startswith(buffer[-n:]):
            return n
    return 0


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass
class CallParser:
    """Reads a choice's text as it streams: content, and calls as they start and grow.

    `feed` returns OpenAI chat deltas (`content`, or `tool_calls` entries with `index`); a head
    the grammar would not have produced (an unconstrained choice) stays text."""

    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    repeated: bool = False  # the model called again exactly as before: the answer ends there
    cut: list[str] = field(default_factory=list)  # calls the text ended inside: left out
    _buffer: str = ""
    _state: str = "text"  # text | head | args | done
    _pending: str = ""  # whitespace held back
    _held_calls: list[dict[str, Any]] = field(default_factory=list)  # the open call's deltas

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._state == "done":
            return []
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        while True:
            before = (self._state, len(self._buffer))
            deltas += self._step()
            if (self._state, len(self._buffer)) == before:
                return deltas

    def finish(self) -> list[dict[str, Any]]:
        """What is left: text; a call the text ended inside is dropped (named in `cut`)."""
        rest, self._buffer = self._buffer, ""
        if self._state == "done":
            return []
        if self._state == "args":
            self.cut.append(self.calls.pop().name)
            self._held_calls, self._state = [], "done"
            return []
        if self._state == "head" and _could_be_head(rest):  # ended inside a call's head
            self.cut.append("a call")
            self._state = "done"
            return []
        if self._state == "head":
            rest = TRIGGER + rest
        self._state = "text"
        return self._text(rest, final=True)

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """Once the text is all fed: the content (None when only calls) and the calls."""
        self.finish()
        return (self.content.strip() or None), self.calls

    def _step(self) -> list[dict[str, Any]]:
        if self._state == "text":
            before, found = self._take_until(TRIGGER)
            if found:
                self._state = "head"
            return self._text(before)
        buf = self._buffer
        if self._state == "head":
            match = _HEAD.match(buf)
            if match is None:
                if len(buf) >= _HEAD_MAX or not _could_be_head(buf):
                    self._state, self._buffer = "text", ""
                    return self._text(TRIGGER + buf)
                return []
            call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", match.group(1))
            self.calls.append(call)
            self._state, self._buffer = "args", buf[match.end() :]
            fn = {"name": call.name, "arguments": ""}
            entry = {"index": len(self.calls) - 1, "id": call.id, "type": "function"}
            return self._out([{"tool_calls": [{**entry, "function": fn}]}])
        before, found = self._take_until(END)
        out = self._args(before)
        if found:
            self._state = "text"
            out += self._complete()
        return out

    def _take_until(self, marker: str) -> tuple[str, bool]:
        """The buffer's text before `marker` (consumed with it), and whether it was there;
        without it, all but a tail that could begin it."""
        buf = self._buffer
        at = buf.find(marker)
        if at >= 0:
            self._buffer = buf[at + len(marker) :]
            return buf[:at], True
        keep = _held(buf, marker)
        self._buffer = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _complete(self) -> list[dict[str, Any]]:
        """A call is sent once whole, unless it repeats an earlier one: a small model's loop
        (it would run to max_tokens and end cut); it is dropped and the answer ends."""
        held, self._held_calls = self._held_calls, []
        last = self.calls[-1]
        if any(_same(last, c) for c in self.calls[:-1]):
            self.calls.pop()
            self.repeated, self._state, self._buffer = True, "done", ""
            return []
        return held

    def _out(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self._held_calls += deltas  # until the call is whole (_complete)
        return []

    def _args(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.calls[-1].arguments += text
        entry = {"index": len(self.calls) - 1, "function": {"arguments": text}}
        return self._out([{"tool_calls": [entry]}])

    def _text(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Content; whitespace alone (between calls) is held until real text follows."""
        self._pending += text
        if not self._pending.strip() and not final:
            return []
        out, self._pending = self._pending, ""
        if not out.strip():  # only whitespace at the very end: nothing to say
            return []
        self.content += out
        return [{"content": out}]


def _same(a: ToolCall, b: ToolCall) -> bool:
    if a.name != b.name:
        return False
    try:
        return bool(json.loads(a.arguments) == json.loads(b.arguments))
    except (ValueError, RecursionError):
        return a.arguments == b.arguments


def _could_be_head(buf: str) -> bool:
    """Whether `buf` may still grow into a call's head (before `_HEAD` can match)."""
    probe = '\n{"name": "'
    if len(buf) <= len(probe):
        return probe.startswith(buf)
    return buf.startswith(probe)


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole choice: its content (None when only calls) and its calls."""
    parser = CallParser()
    parser.feed(text)
    return parser.result()


def cut_warnings(parser: CallParser) -> list[str]:
    return [
        f"tool_calls: the answer ended inside {_called(name)} (max_tokens); it was left out"
        for name in parser.cut
    ]


def _called(name: str) -> str:
    return name if name == "a call" else f"a call of {name}"


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's `tool_calls` when the answer ended by itself after calling."""
    return "tool_calls" if calls and reason == "stop" else reason


async def validate(
    body: ChatCompletionRequest, calls: list[ToolCall], tenant: str = "default"
) -> tuple[bool | None, list[str]]:
    """Each call's arguments against its function's `parameters`, in a killable worker under a
    time bound (the schema is the tenant's: services/sandbox/validate.py says why a thread would
    not do). None: there was no call."""
    if not calls:
        return None, []
    schemas = {t.function.name: _schema(t.function.parameters) for t in body.tools or ()}
    checks = [(schema_text(schemas[c.name]), c.arguments) for c in calls]
    verdicts = await asyncio.to_thread(_validator().check, checks, tenant)
    problems = [
        f"tool_calls[{call.name}]: " + (why or "").replace("output failed", "arguments failed")
        for call, (ok, why) in zip(calls, verdicts, strict=True)
        if not ok
    ]
    return not problems, [p[:300] for p in problems]


_VALIDATOR: list[SchemaValidator] = []  # this process's, made on first use


def _validator() -> SchemaValidator:
    if not _VALIDATOR:
        _VALIDATOR.append(SchemaValidator(workers=2, timeout_s=VALIDATE_TIMEOUT_S))
    return _VALIDATOR[0]
