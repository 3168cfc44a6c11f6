"""The structural tag an answer is held to: the dialect's thinking block (as the prompt left it),
then text and/or calls as `tool_choice` asks, or the response format's schema."""

from __future__ import annotations

import functools
import json
from typing import Any


def tag_for(
    dialect: str,
    tools: list[dict[str, Any]],
    tool_choice: Any = "auto",
    parallel: bool = True,
    reasoning: str = "disabled",
    max_whitespace_cnt: int | None = 8,
) -> dict[str, Any]:
    """The structural tag an answer in `dialect` is held to: an optional thinking block
    (`reasoning`: enabled (the prompt opened it), auto, disabled), then text and/or calls as
    `tool_choice` asks (auto, required, or {"type": "function", "function": {"name": ...}})."""
    from xgrammar import get_model_structural_tag

    style = "qwen_3" if dialect == "hermes" else dialect
    if reasoning not in ("enabled", "disabled", "auto"):
        raise ValueError(f"reasoning: enabled, disabled or auto, got {reasoning!r}")
    tag = get_model_structural_tag(
        style,
        tools=list[Any](tools),
        tool_choice=tool_choice,
        reasoning="disabled" if dialect == "hermes" else reasoning,  # type: ignore[arg-type]
        parallel_tool_calls=parallel,
        max_whitespace_cnt=max_whitespace_cnt,  # a run of it in arguments is a small model's loop
    )
    out: dict[str, Any] = json.loads(tag.model_dump_json(exclude_none=True))
    if tool_choice == "required":
        out["format"] = _calls_only(out["format"])
    return out


def _calls_only(fmt: dict[str, Any]) -> dict[str, Any]:
    """`required` as calls only: xgrammar's styles that trigger calls inside free text keep the
    text allowed around them when one call is required; here the answer is its calls (after any
    thinking), as OpenAI's `required` reads and a parser can rely on."""
    if fmt.get("type") == "sequence" and fmt.get("elements"):
        return {**fmt, "elements": [*fmt["elements"][:-1], _calls_only(fmt["elements"][-1])]}
    if fmt.get("type") != "triggered_tags":
        return fmt
    one = fmt.get("stop_after_first", False)
    return {
        "type": "tags_with_separator",
        "tags": fmt["tags"],
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": one,
    }


def _thinking(dialect: str, mode: str) -> dict[str, Any] | None:
    """The dialect's thinking block alone (what `mode` puts before its answer), or None where
    it has none apart (`none`, `hermes`, `llama`; harmony weaves it into its channels)."""
    found = _thinking_text(dialect, mode)
    return None if found is None else json.loads(found)  # a copy: the caller's to nest


@functools.cache  # two of xgrammar's tags built per dialect and mode, not per request
def _thinking_text(dialect: str, mode: str) -> str | None:
    if dialect in ("none", "hermes") or mode == "disabled":
        return None
    on = tag_for(dialect, [], "auto", True, mode)["format"]
    off = tag_for(dialect, [], "auto", True, "disabled")["format"]
    elements = on.get("elements", [])
    return (
        json.dumps(elements[0]) if on.get("type") == "sequence" and elements[1:] == [off] else None
    )


@functools.cache
def markers(dialect: str) -> tuple[str, str] | None:
    """The dialect's thinking block's opening and closing markers (`<think>`, `</think>`; for
    harmony, its analysis channel's, woven among its other channels)."""
    block = _thinking(dialect, "auto") or _analysis_channel(dialect)
    while block is not None and block.get("type") != "tag":
        block = block.get("content") or (block.get("elements") or [None])[0]
    if block is None:
        return None
    end = block["end"] if isinstance(block["end"], str) else block["end"][0]
    return block["begin"], end


def _analysis_channel(dialect: str) -> dict[str, Any] | None:
    if dialect in ("none", "hermes"):
        return None
    return _find(tag_for(dialect, [], "auto", True, "auto")["format"])


def _find(node: Any) -> dict[str, Any] | None:
    """The first tag whose `begin` opens an analysis channel."""
    if isinstance(node, list):
        return next((f for f in map(_find, node) if f is not None), None)
    if not isinstance(node, dict):
        return None
    if node.get("type") == "tag" and "analysis" in str(node.get("begin", "")):
        return node
    return _find([v for v in node.values() if isinstance(v, (dict, list))])


def reasoning_mode(prompt: str, dialect: str, template_thinks: bool) -> str:
    """How the rendered prompt leaves thinking: `enabled` (it ends inside an opened block, as
    Qwen3's and DeepSeek-R1's generation prompts do), `disabled` (it closed an empty one, as
    `enable_thinking: false` renders, or the template has none), else `auto` (the model may
    open one). Read from the prompt, never guessed from the model's name."""
    found = markers(dialect)
    if found is None or not template_thinks:
        return "disabled"
    opener, closer = found
    tail = prompt.rstrip()
    if tail.endswith(closer):
        return "disabled"
    if tail.endswith(opener):
        return "enabled"
    return "auto"


def answer_tag(
    dialect: str,
    reasoning_dialect: str,
    mode: str,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = "auto",
    parallel: bool = True,
    schema: dict[str, Any] | None = None,
    max_whitespace_cnt: int | None = 8,
) -> dict[str, Any]:
    """One structural tag for a whole answer: `reasoning_dialect`'s thinking block as `mode`
    leaves it, then `dialect`'s calls (with free text under `auto`) when there are tools, else
    the response format's `schema`, else free text."""
    calls = bool(tools) and tool_choice != "none" and dialect != "none"
    if calls and reasoning_dialect == dialect:  # the dialect weaves its own thinking in
        return tag_for(dialect, tools or [], tool_choice, parallel, mode, max_whitespace_cnt)
    answer: dict[str, Any]
    if calls:
        answer = tag_for(
            dialect, tools or [], tool_choice, parallel, "disabled", max_whitespace_cnt
        )["format"]
    elif schema is not None:
        answer = {"type": "json_schema", "json_schema": schema}
        if max_whitespace_cnt is not None:
            answer["max_whitespace_cnt"] = max_whitespace_cnt
    else:
        answer = {"type": "any_text"}
    thinking = _thinking(reasoning_dialect, mode)
    fmt = answer if thinking is None else {"type": "sequence", "elements": [thinking, answer]}
    return {"type": "structural_tag", "format": fmt}
