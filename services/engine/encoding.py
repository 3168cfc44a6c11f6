"""Prompts to token ids, off the caller's event loop and off the engine's step loop.

`Encoder` templates and tokenizes on small pools of its own (one for requests, one for the
`/tokenize` route, so that route cannot queue generation): neither the caller's event loop nor
the engine pays for a long prompt. The template renders in killable workers
(services/engine/chat_template.py), so an encode thread waits at most the render's deadline;
`stalled` says when encodes stop making progress.

`Front` is what encoding needs of a model without the model (the tokenizer, the template
renderer, the admission limits): the replica's side when the engine core runs in a process of
its own (core_client.py). `LLMEngine` offers the same names in-process.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.engine import admission
from services.engine.admission import Limits, Prompt
from services.engine.chat_template import ChatRenderer
from services.engine.config import EngineConfig

# An encode this long past the render's deadline and its wait for a worker is stuck somewhere no
# deadline reaches: health checks say so.
ENCODE_GRACE_S = 30.0


class Front:
    def __init__(self, config: EngineConfig, limits: Limits) -> None:
        from transformers import AutoTokenizer

        from services.models.loader import resolve_model_dir

        _, path = resolve_model_dir(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.chat = ChatRenderer(self.tokenizer, config.sandbox_workers, config.template_timeout_s)
        self.limits = limits
        self.max_model_len = limits.max_model_len

    def tokenize(self, prompt: Prompt) -> list[int]:
        return admission.tokenize(self.tokenizer, prompt, self.limits.max_prompt_chars)

    def apply_chat_template(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        return self.chat.ids(messages, self.limits.max_prompt_chars, **options)


class Encoder:
    def __init__(self, front: Any) -> None:
        self.front = front  # an LLMEngine or a Front
        self._requests = ThreadPoolExecutor(2, thread_name_prefix="encode")
        self._route = ThreadPoolExecutor(1, thread_name_prefix="tokenize-route")
        self._encoding: dict[int, float] = {}  # encode in flight -> when it started

    async def encode(
        self,
        prompt: Prompt | None = None,
        messages: list[dict[str, Any]] | None = None,
        template: dict[str, Any] | None = None,
        tenant: str = "default",
        route: bool = False,
    ) -> list[int]:
        """Token ids of a prompt or of chat messages (templated with `template` options);
        `ValueError` naming the field when they are over `max_prompt_chars` or the template
        refuses them. `route`: for the `/tokenize` route, on its own thread."""
        front = self.front
        if messages is not None:
            options = {**(template or {}), "tenant": tenant}
            call = functools.partial(front.apply_chat_template, messages, **options)
        elif prompt is not None:
            call = functools.partial(front.tokenize, prompt)
        else:
            raise ValueError("prompt: give a prompt or messages")
        pool = self._route if route else self._requests
        return await asyncio.get_running_loop().run_in_executor(pool, self._timed, call)

    def _timed(self, call: Any) -> list[int]:
        key = threading.get_ident()
        self._encoding[key] = time.monotonic()
        try:
            ids: list[int] = call()
            return ids
        finally:
            self._encoding.pop(key, None)

    def stalled(self) -> str | None:
        """Why prompts cannot be encoded, or None."""
        chat = self.front.chat
        if stalled := chat.stalled():
            return str(stalled)
        limit = chat.timeout_s + chat.wait_s + ENCODE_GRACE_S
        oldest = min(self._encoding.values(), default=None)
        if oldest is not None and time.monotonic() - oldest > limit:
            return f"an encode has run {time.monotonic() - oldest:.0f} s"
        return None

    def shutdown(self) -> None:
        self._requests.shutdown(wait=False, cancel_futures=True)
        self._route.shutdown(wait=False, cancel_futures=True)
        self.front.chat.close()
