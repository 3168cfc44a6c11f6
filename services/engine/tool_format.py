"""How a tool call looks in the model's text, and how tools reach a template that knows none.

One format, Hermes-style (the one Qwen2.5/3, Hermes and SmolLM3 templates teach):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The HTTP layer constrains calls to exactly this text and parses it back (deployments/tools.py);
this module renders past calls and results into a conversation. A template that takes `tools`
(it mentions them) gets them as they are; any other template (SmolLM2's) gets them through a
system prompt of ours, and past calls and results as plain text in this format.
"""

from __future__ import annotations

import json
from typing import Any

TRIGGER = "<tool_call>"
END = "}\n</tool_call>"


def call_begin(name: str) -> str:
    """The text before a call's arguments (names are plain: `[A-Za-z0-9_.-]`)."""
    return f'{TRIGGER}\n{{"name": "{name}", "arguments": '


def render_call(name: str, arguments: Any) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return call_begin(name) + args + END


_FALLBACK = """You can call functions to help with the request. The functions you have, one JSON \
object each:
<tools>
{tools}
</tools>
To call one, answer with the call alone, in exactly this form (one block per call):
<tool_call>
{{"name": "the function's name", "arguments": {{the arguments as a JSON object}}}}
</tool_call>
The result comes back inside <tool_response></tool_response>."""


def template_takes_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """One message with past calls and results as text, for a template that knows neither."""
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        blocks = [render_call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return {"role": role, "content": "\n".join([content, *blocks]).strip()}
    return {"role": role, "content": content}


def fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: the tools in a system prompt
    (before the caller's own system message, if any), calls and results as text."""
    out = [_plain(m) for m in messages]
    if not tools:
        return out
    listing = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    prompt = _FALLBACK.format(tools=listing)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": prompt + "\n\n" + out[0]["content"]}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
