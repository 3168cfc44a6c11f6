"""The model's chat template rendered under a deadline and an output bound.

The template is the operator's (a request cannot bring its own: services/engine/chat_template.py
keeps `chat_template_kwargs` to plain variables), but what it renders is the tenant's: messages,
tools, variables. A Jinja render holds the GIL and cannot be stopped, so it runs in `render`
worker processes (sandbox/pool.py) that a deadline kills, with an address-space cap; a rendered
text over `max_chars` is refused there, before it crosses back or reaches a tokenizer.
`render_text` is the one render both sides use (the in-process twin calls it directly): the same
call `tokenizer.apply_chat_template` makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template


class RenderRefused(ValueError):
    """A render that cannot be answered with a prompt; `status` is the HTTP answer's."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def render_text(job: dict[str, Any], special: dict[str, Any]) -> str:
    """`job`: `template` (Jinja source), `messages`, `tools`, `add_generation_prompt`,
    `continue_final_message`, `variables` (the client's plain template variables), `max_chars`.
    The special tokens come first, as in `apply_chat_template`, so a variable may not pose as
    one (the allow-list refuses those names anyway)."""
    try:
        # (texts, generation indices); typed as a str upstream
        rendered: Any = render_jinja_template(
            conversations=[job["messages"]],
            tools=job.get("tools"),
            chat_template=job["template"],
            add_generation_prompt=bool(job.get("add_generation_prompt")),
            continue_final_message=bool(job.get("continue_final_message")),
            **{**special, **job.get("variables", {})},
        )
    except MemoryError:
        raise
    except Exception as exc:  # the template's own checks (roles, their order) raise
        raise RenderRefused(f"messages: the chat template refused them ({exc})"[:300]) from exc
    text: str = rendered[0][0]
    if len(text) > job["max_chars"]:
        raise RenderRefused(
            f"messages: the rendered prompt's {len(text)} characters exceed the limit of "
            f"{job['max_chars']} (max_prompt_chars)"
        )
    return text


def handler(setup: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The `render` role (sandbox/worker.py); `setup["special"]`: the tokenizer's special tokens
    map, which every render sees."""
    special = dict(setup.get("special") or {})

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"ok": True, "text": render_text(job, special)}
        except RenderRefused as exc:
            return {"ok": False, "reason": "refused", "error": str(exc)}
        except MemoryError:
            error = "messages: rendering the chat template ran out of its memory cap"
            return {"ok": False, "reason": "memory", "error": error}

    return handle
