"""Chat with tools and thinking, offline: the prompt rendered with the tools, the answer held to
one structural tag in the model's dialect (services/dialects), read back into reasoning,
content and calls by walking that tag.

The dialect is the chat template's (`auto`, detected once at start-up and logged) unless named
(`LLM(tool_call_format=..., reasoning_format=...)`). Whether an answer opens with thinking
follows the rendered prompt: a generation prompt that opened the block (Qwen3, DeepSeek-R1), one
that closed an empty block (`chat_template_kwargs={"enable_thinking": False}`), or neither (the
model may open one). A response format's schema holds what follows the thinking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from services.dialects import (
    Answer,
    answer_tag,
    check,
    detect,
    markers,
    reasoning_mode,
    split,
    thinks,
)
from services.engine.params import RequestOutput, SamplingParams, Thinking
from services.grammar.finish import bounded
from services.grammar.structured import MAX_WHITESPACE_CNT, StructuredOutput
from services.grammar.xgrammar_backend import schema_dict
from services.sandbox.validate import Validators, schema_text

log = logging.getLogger(__name__)
_TAIL_TOKENS = 16  # of the rendered prompt, read for the thinking block's markers


@dataclass(frozen=True)
class Dialect:
    """The served model's call dialect and thinking dialect (`none`: no thinking block)."""

    tools: str
    reasoning: str
    thinks: bool  # the template may open a thinking block
    why: str


def check_names(tool_call_format: str, reasoning_format: str) -> None:
    check(tool_call_format, "tool_call_format")
    check(reasoning_format, "reasoning_format")


def resolve(
    tokenizer: Any, tool_call_format: str = "auto", reasoning_format: str = "auto"
) -> Dialect:
    """The dialects to serve, from the settings and the chat template; unknown names fail."""
    check_names(tool_call_format, reasoning_format)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = " ".join(str(t) for t in template.values())
    found, why = detect(template)
    tools = found if tool_call_format == "auto" else tool_call_format
    why = why if tool_call_format == "auto" else "tool_call_format names it"
    thinking = thinks(template)
    if reasoning_format == "auto":
        reasoning = tools if thinking else "none"
    else:
        reasoning, thinking = reasoning_format, reasoning_format != "none"
    log.info("dialect: calls %s, thinking %s (%s)", tools, reasoning, why)
    return Dialect(tools, reasoning, thinking, why)


@dataclass(frozen=True)
class Turn:
    """One conversation's request: its prompt, its params (held to `tag` where there is
    anything to hold), and what reading the answer back needs."""

    prompt: list[int]
    params: SamplingParams
    tag: dict[str, Any]
    schema: dict[str, Any] | None
    parameters: dict[str, Any]  # each tool's arguments schema, as the caller gave it
    split: bool = True  # the answer may hold thinking or calls (else it is all content)


def plan(
    engine: Any,
    dialect: Dialect,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = "auto",
    parallel_tool_calls: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Turn:
    """The conversation rendered with its tools, then shaped (`shape`)."""
    calls = bool(tools) and tool_choice != "none"
    options = dict(chat_template_kwargs or {})
    if calls:
        options["tools"] = tools
    prompt = engine.apply_chat_template(messages, **options)
    return shape(engine, dialect, prompt, params, tools, tool_choice, parallel_tool_calls)


def shape(
    engine: Any,
    dialect: Dialect,
    prompt: list[int],
    params: SamplingParams,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = "auto",
    parallel_tool_calls: bool = True,
) -> Turn:
    """A rendered prompt's turn: its answer held to one structural tag in the dialect (the
    thinking block as the prompt's end leaves it, then calls, the response format's schema or
    text), its thinking budget given the block's markers. The replica shapes each chat request
    this way after rendering it; `LLM.chat` does both."""
    calls = bool(tools) and tool_choice != "none"
    tail = engine.tokenizer.decode(prompt[-_TAIL_TOKENS:])
    mode = reasoning_mode(tail, dialect.reasoning, dialect.thinks)
    so = params.structured
    schema = None  # a response format (dict, JSON text or pydantic class), held after thinking
    if so is not None and so.json_schema is not None:
        schema = schema_dict(so.json_schema)
    elif so is not None and so.json_object:
        schema = {"type": "object"}
    held = [_bounded(t) for t in tools or ()] if calls else None
    spaces = so.max_whitespace_cnt if so is not None else MAX_WHITESPACE_CNT
    tag = answer_tag(
        dialect.tools,
        dialect.reasoning,
        mode,
        held,
        tool_choice,
        parallel_tool_calls,
        schema,
        spaces,
    )
    found = markers(dialect.reasoning)
    if params.thinking_token_budget is not None and mode != "disabled" and found is not None:
        ids = tuple(engine.tokenizer.encode(found[1], add_special_tokens=False))
        params = replace(params, thinking=Thinking(mode == "enabled", *found, ids))
    if calls or (schema is not None and mode != "disabled"):
        if so is not None and so.kind not in ("json_schema", "json_object"):
            raise ValueError(
                f"structured.{so.kind}: only a JSON schema goes with tools or thinking"
            )
        params = replace(params, structured=StructuredOutput(structural_tag=tag))
    listed = [t["function"] for t in tools or () if calls]
    parameters = {f["name"]: f.get("parameters") or {"type": "object"} for f in listed}
    checked = schema if params.structured is not so else None
    split_needed = calls or mode != "disabled"
    return Turn(prompt, params, tag, checked, parameters, split_needed)


def _bounded(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool whose arguments' numbers are bounded as a schema's are (grammar/finish.py)."""
    function = tool.get("function", {})
    parameters = function.get("parameters")
    if not isinstance(parameters, dict):
        return tool
    return {**tool, "function": {**function, "parameters": bounded(parameters)}}


_validators = Validators()


def read(turn: Turn, out: RequestOutput) -> RequestOutput:
    """`out` with its answer split: `reasoning_text`, `content`, `tool_calls`; a call the text
    ended inside (max_tokens) is left out and said in `warnings`; each call's arguments and, with
    a response format's schema, the content are validated (`validated`, the reasons in
    `warnings`)."""
    answer: Answer = split(turn.tag, out.text, list(turn.parameters))
    out.reasoning_text = answer.reasoning or None
    out.content = answer.content or None
    out.tool_calls = answer.calls
    for name in answer.cut:
        out.warnings.append(f"tool_calls: the answer ended inside a call of {name}; left out")
    checks = [
        (turn.parameters.get(c.name, {}), c.arguments, f"tool_calls[{c.name}]")
        for c in answer.calls
    ]
    if turn.schema is not None and out.finish_reason == "stop":
        checks.append((turn.schema, answer.content, "content"))
    if checks:  # a non-strict tool's arguments too: parsed and validated, never constrained
        verdicts = [(_validators.verdict(schema_text(s), text), where) for s, text, where in checks]
        out.validated = all(ok for (ok, _), _ in verdicts)
        out.warnings += [f"{where}: {why}" for (ok, why), where in verdicts if not ok]
    return out
