"""Chat messages to token ids through the model's own template, with the client's variables kept
to plain ones and the render bounded.

`chat_template_kwargs` carries template variables only (vLLM refuses a request's own template
unless the operator trusts it; we never do): a name `apply_chat_template` takes itself
(`chat_template`, `tools`, `return_tensors`, `max_length`, ...), a special token's name or one
of the template's globals is refused naming it, and so is a value that is not a plain scalar or
a short list of them. The render runs in killable workers (services/sandbox/render.py) under
`timeout_s`; its text is capped at `max_chars` before it is tokenized.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping
from typing import Any

from services.engine import tool_format
from services.sandbox.pool import LazyPool
from services.sandbox.render import RenderRefused, render_text

FIELD = "chat_template_kwargs"
MAX_VARIABLES = 32
MAX_LIST_ITEMS = 64
MAX_STRING_CHARS = 4096
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# Set by the caller, never by the client's variables: what the template iterates over and the
# switches the caller reads from the body's own fields.
CONTROL = (
    *("messages", "conversation", "tools", "documents"),
    *("add_generation_prompt", "continue_final_message"),
)
# The globals transformers' template environment defines: a variable of the same name would
# shadow them.
TEMPLATE_GLOBALS = ("raise_exception", "strftime_now", "range", "namespace", "loop")


def reserved_names(tokenizer: Any = None) -> frozenset[str]:
    """What `chat_template_kwargs` may not name: for this tokenizer, or (None) for any
    transformers tokenizer (what the ingress checks, without one)."""
    from transformers import PreTrainedTokenizerBase

    cls = type(tokenizer) if tokenizer is not None else PreTrainedTokenizerBase
    takes = inspect.signature(cls.apply_chat_template).parameters
    own = {n for n, p in takes.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    special = set(PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES) | {"additional_special_tokens"}
    special |= set(getattr(tokenizer, "special_tokens_map", {}) or {})
    return frozenset(own | special | set(CONTROL) | set(TEMPLATE_GLOBALS) | {"self"})


def check_variables(variables: Mapping[str, Any] | None, reserved: frozenset[str]) -> dict:
    """The client's template variables, or `ValueError` naming the first one refused."""
    if not variables:
        return {}
    if not isinstance(variables, Mapping):
        raise ValueError(f"{FIELD}: must be an object of template variables")
    if len(variables) > MAX_VARIABLES:
        raise ValueError(f"{FIELD}: at most {MAX_VARIABLES} template variables")
    for name, value in variables.items():
        where = f"{FIELD}.{str(name)[:64]}"
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}: not a template variable name")
        if name in reserved:
            raise ValueError(
                f"{where}: not a template variable (the service applies the model's own chat "
                "template; only the template's plain variables may be set)"
            )
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and len(value) > MAX_LIST_ITEMS:
            raise ValueError(f"{where}: a list of at most {MAX_LIST_ITEMS} items")
        for item in items:
            if item is not None and not isinstance(item, str | int | float | bool):
                raise ValueError(f"{where}: a string, number, boolean, null or a list of them")
            if isinstance(item, str) and len(item) > MAX_STRING_CHARS:
                raise ValueError(f"{where}: strings of at most {MAX_STRING_CHARS} characters")
    return dict(variables)


class ChatRenderer:
    """Messages to token ids for one tokenizer. `workers=0` renders in the calling thread (the
    plain twin: the same render, no deadline)."""

    def __init__(
        self, tokenizer: Any, workers: int = 2, timeout_s: float = 5.0, wait_s: float = 30.0
    ) -> None:
        self.tokenizer = tokenizer
        self.reserved = reserved_names(tokenizer)
        self.takes_tools = tool_format.template_takes_tools(tokenizer)
        self.special = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
        self.workers, self.timeout_s, self.wait_s = workers, timeout_s, wait_s
        self._pool = LazyPool("render", {"special": self.special}, workers, 1 << 30)

    def ids(
        self,
        messages: list[dict[str, Any]],
        max_chars: int,
        tenant: str = "default",
        **options: Any,
    ) -> list[int]:
        """`options`: `add_generation_prompt` (default True), `continue_final_message`, `tools`,
        and the client's template variables. `ValueError` (a `RenderRefused` with its HTTP
        status) naming the field when anything is over its bound or refused."""
        chars = sum(len(json.dumps(m)) for m in messages)
        if chars > max_chars:
            raise ValueError(
                f"messages: {chars} characters exceed the limit of {max_chars} (max_prompt_chars)"
            )
        generation = bool(options.pop("add_generation_prompt", True))
        final = bool(options.pop("continue_final_message", False))
        tools = options.pop("tools", None)
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise ValueError("tools: must be a list of function definitions")
        variables = check_variables(options, self.reserved)
        if not self.takes_tools:
            messages = tool_format.fallback_messages(messages, tools)
            tools = None
        job = {
            "template": self.tokenizer.get_chat_template(None, tools),
            "messages": _plain_messages(messages),
            "tools": tools,
            "add_generation_prompt": generation,
            "continue_final_message": final,
            "variables": variables,
            "max_chars": max_chars,
        }
        text = self._render(job, tenant)
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _render(self, job: dict[str, Any], tenant: str) -> str:
        if not self.workers:
            return render_text(job, self.special)
        out = self._pool.run(job, self.timeout_s, self.wait_s, tenant)
        if out.get("ok"):
            text: str = out["text"]
            return text
        reason, error = out.get("reason"), str(out.get("error", ""))
        if reason in ("refused", "memory"):
            raise RenderRefused(error, 400)
        if reason == "timeout":
            message = f"messages: the chat template did not render within {self.timeout_s:g} s"
            raise RenderRefused(message, 400)
        if reason == "busy":
            raise RenderRefused("messages: every chat-template renderer is busy; try again", 503)
        raise RenderRefused(f"messages: the chat template could not be rendered ({error})", 503)

    def stalled(self) -> str:
        """Why renders cannot make progress now ('' when they can)."""
        return self._pool.stalled()

    def close(self) -> None:
        self._pool.close()


def _plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `apply_chat_template` renders: each message without its None values."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]
