"""The Responses API's answers: a chat completion read into a Response object, and its chunks,
as they stream, into the Responses API's typed events.

A response's output is its items in the order the model wrote them: a `reasoning` item (the
thinking, as `reasoning_text`), a `message` (the content, as `output_text`), `function_call`
items (each whole: a call is sent once its end is written, as on chat). Streamed, each item is
opened (`response.output_item.added`), grown (`response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`) and closed
(`...done`, `response.output_item.done`); `response.completed` (or `response.incomplete` at
`max_output_tokens`, `response.failed` on an error) carries the whole response last.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from deployments.protocol import now
from deployments.responses_protocol import NamedFunction, ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def shell(body: ResponsesRequest, rid: str, created: int) -> dict[str, Any]:
    """The response object before its output: what the request asked for, echoed."""
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, NamedFunction):
        choice = choice.model_dump()
    fmt = body.text.format if body.text is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    effort = body.reasoning.effort if body.reasoning is not None else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "model": body.model,
        "output": [],
        "instructions": body.instructions,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "text": text,
        "reasoning": {"effort": effort, "summary": None},
        "store": False,
        "previous_response_id": None,
        "truncation": "disabled",
        "metadata": (body.model_extra or {}).get("metadata") or {},
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("completion_tokens_details") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }


def _reasoning(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {
        "type": "reasoning",
        "id": _id("rs"),
        "summary": [],
        "content": content,
        "status": status,
    }


def _message(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    content = [part] if text or status == "completed" else []
    return {
        "type": "message",
        "id": _id("msg"),
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def _ended(response: dict[str, Any], reason: str | None, warnings: list[str]) -> str:
    """The response's status from the chat finish reason; the event type that ends it."""
    if reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        return "response.incomplete"
    if reason == "error":
        response["status"] = "failed"
        message = warnings[-1] if warnings else "the answer failed"
        response["error"] = {"code": "server_error", "message": message}
        return "response.failed"
    response["status"] = "completed"
    return "response.completed"


def response_of(body: ResponsesRequest, rid: str, answer: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion (one choice) as a response."""
    out = shell(body, rid, answer["created"])
    choice = answer["choices"][0]
    message = choice["message"]
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message(message["content"]))
    items += [_call(c) for c in message.get("tool_calls") or ()]
    out["output"] = items
    out["usage"] = _usage(answer["usage"])
    extra = answer["structserve"]
    _ended(out, choice["finish_reason"], extra["warnings"][0])
    out["structserve"] = {"validated": extra["validated"][0], "warnings": extra["warnings"][0]}
    return out


class _Stream:
    """The typed events of one streamed response, from its chat chunks."""

    def __init__(self, body: ResponsesRequest, rid: str) -> None:
        self.response = shell(body, rid, now())
        self.seq = 0
        self.item: dict[str, Any] | None = None  # the item open now
        self.text = ""  # its text so far
        self.reason: str | None = None
        self.extra: dict[str, Any] = {"validated": None, "warnings": []}

    def event(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj)}\n\n"

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    @property
    def index(self) -> int:
        return len(self.response["output"])

    def open(self, item: dict[str, Any]) -> list[str]:
        self.item, self.text = item, ""
        return [self.event("response.output_item.added", output_index=self.index, item=item)]

    def grow(self, kind: str, delta: str) -> list[str]:
        """Text of the open item, opening it (a reasoning item or a message) if need be."""
        out: list[str] = []
        if self.item is None or self.item["type"] != kind:
            out += self.close()
            out += self.open(
                _reasoning("", "in_progress")
                if kind == "reasoning"
                else _message("", "in_progress")
            )
            part = (
                {"type": "reasoning_text", "text": ""}
                if kind == "reasoning"
                else _message("")["content"][0]
            )
            out.append(self.event("response.content_part.added", **self._at(), part=part))
        self.text += delta
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, **self._at(), delta=delta, **extra))
        return out

    def _at(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": self.index, "content_index": 0}

    def close(self) -> list[str]:
        """The open item's end; it joins the output."""
        item = self.item
        if item is None:
            return []
        text, at = self.text, self._at()
        if item["type"] == "reasoning":
            done = {**_reasoning(text), "id": item["id"]}
            part = done["content"][0]
            out = [self.event("response.reasoning_text.done", **at, text=text)]
        else:
            done = {**_message(text), "id": item["id"]}
            part = done["content"][0]
            out = [self.event("response.output_text.done", **at, text=text, logprobs=[])]
        out.append(self.event("response.content_part.done", **at, part=part))
        out.append(self.event("response.output_item.done", output_index=self.index, item=done))
        self.response["output"].append(done)
        self.item = None
        return out

    def call(self, entry: dict[str, Any]) -> list[str]:
        """A whole call: opened, its arguments in one delta, closed."""
        out = self.close()
        done = _call(entry)
        out += self.open({**done, "arguments": "", "status": "in_progress"})
        at = {"item_id": done["id"], "output_index": self.index}
        args = done["arguments"]
        out.append(self.event("response.function_call_arguments.delta", **at, delta=args))
        out.append(
            self.event(
                "response.function_call_arguments.done", **at, arguments=args, name=done["name"]
            )
        )
        out.append(self.event("response.output_item.done", output_index=self.index, item=done))
        self.response["output"].append(done)
        self.item = None
        return out

    def chunk(self, obj: dict[str, Any]) -> list[str]:
        if "error" in obj:  # the replica failed mid-stream: the response fails
            error = obj["error"]
            self.reason = "error"
            self.extra = {"validated": None, "warnings": [error.get("message")]}
            message = error.get("message")
            return [self.event("error", code=error.get("type"), message=message, param=None)]
        if obj.get("usage"):
            self.response["usage"] = _usage(obj["usage"])
        out: list[str] = []
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self.grow("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self.grow("message", delta["content"])
            for entry in delta.get("tool_calls") or ():
                out += self.call(entry)
            if choice.get("finish_reason") is not None:
                self.reason = choice["finish_reason"]
        if "structserve" in obj:
            self.extra = obj["structserve"]
        return out

    def end(self) -> list[str]:
        out = self.close()
        kind = _ended(self.response, self.reason, self.extra.get("warnings") or [])
        self.response["structserve"] = self.extra
        return [*out, self.event(kind, response=self.response)]


async def events(
    body: ResponsesRequest, rid: str, chunks: AsyncIterator[str]
) -> AsyncIterator[str]:
    """The typed events of a streamed response, from its chat completion's server-sent events."""
    stream = _Stream(body, rid)
    for e in stream.start():
        yield e
    async for line in chunks:
        data = line.removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        for e in stream.chunk(json.loads(data)):
            yield e
    for e in stream.end():
        yield e
