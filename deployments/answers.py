"""How the ingress answers: the OpenAI error shape, a whole completion, or server-sent events.

`ApiError` carries an HTTP status (and, for a 429, the reason telemetry counts); `collect` and
`sse` read the replica streams of one request's choices and build the answer.

Finish reasons are the engine's own: a choice that failed after its first token (a grammar
error, masks over budget, an output that failed validation) ends in `"error"`, never `"stop"`,
and its reason is in `structserve.warnings`, which the last chunk of each streamed choice
carries too, with `structserve.validated`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse

from deployments import logprobs, tools
from deployments.observe import RequestObs
from deployments.protocol import body_message, error_body, now
from deployments.wire import Delta

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        retry_after: float | None = None,
        reason: str | None = None,  # of a 429 (REASONS_429)
        code: str | None = None,  # OpenAI's error code, e.g. model_not_found
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.retry_after = status, param, retry_after
        self.reason, self.code = reason, code


# Why a 429: the error's `code`, so a client can tell waiting (Retry-After) from asking for less.
REASONS_429 = (
    "rate",  # the tenant's requests per minute
    "concurrency",  # the tenant's concurrent requests
    "tokens",  # the tenant's tokens per minute
    "replica_busy",  # every model replica's queue is full
    "grammar_busy",  # the compile service is at its limit (for everyone, or for this tenant)
    "kv_tier_full",  # the KV host tier has no room for the tenant's pages now
    "registrations_cap",  # the tenant's grammar registrations are at their cap (delete some)
    "adapters_cap",  # the tenant's adapter registrations (count or bytes) are at their cap
    "files_cap",  # the tenant's files (count or bytes) are at their cap (delete some)
    "batches_cap",  # the tenant's batches in flight are at their cap (wait for one to end)
)

KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_kind(status: int) -> str:
    """OpenAI's error `type` for a status: any other 4xx is the client's, a 5xx the server's."""
    return KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")


def _readers(body: Any, firsts: list[Delta]) -> list[tools.AnswerReader | None]:
    """Each choice's reader, when its replica said how to split its answer (thinking or
    calls: replica.py); None: the text is all content."""
    reasoning = getattr(body, "include_reasoning", True)
    return [
        tools.AnswerReader(f.answer.tag, f.answer.names, reasoning) if f.answer else None
        for f in firsts
    ]


def ends_at_repeat(reader: tools.AnswerReader | None, last: Delta) -> bool:
    """Whether a repeated tool call (tools.AnswerReader) ends the choice at `last`: always once
    the reader saw one, unless the choice already failed. The engine may have run past the
    repeat to `max_tokens` in the same delta (several tokens a step with drafts, or a slow
    reader): the answer still ended at the repeat, whole, so its reason must not read `length`."""
    return reader is not None and reader.repeated and last.finish_reason != "error"


def repeated_end(last: Delta) -> Delta:
    """The end of a choice cut short after a repeated tool call (tools.AnswerReader)."""
    why = "tool_calls: the model repeated an earlier call; the answer ended there"
    return replace(
        last, finished=True, finish_reason="stop", validated=None, error_status=None, warnings=[why]
    )


async def _tool_verdict(
    obs: RequestObs, body: Any, result: Delta, reader: tools.AnswerReader, schema: Any
) -> Delta:
    """A choice's last delta once its calls are known: its finish reason, and its arguments'
    validation (and the content's, against a response format held after thinking) in its
    `validated` and `warnings`, as a schema's are, beside any call left out cut."""
    calls = reader.calls
    content = None
    if schema is not None and result.finish_reason == "stop":
        content = (schema, reader.content)
    validated, problems = await tools.validate(body, calls, obs.tenant, content)
    warnings = [*result.warnings, *tools.cut_warnings(reader)]
    if validated is not None:
        result = replace(result, validated=validated)
        warnings = [*warnings, *problems]
    reason = tools.finish_reason(result.finish_reason, calls)
    return replace(result, warnings=warnings, finish_reason=reason)


def engine_refusal(first: Delta) -> ApiError:
    """A request the replica refused before its first token, as the HTTP error it maps to."""
    message = body_message(first.warnings[-1]) if first.warnings else "request refused"
    status = first.error_status or 400
    field = message.split(":")[0]
    if status == 503:  # the engine restarting, a render that could not run: soon, again
        return ApiError(503, message, field, retry_after=5)
    if status != 429:
        return ApiError(status, message, field)
    reason = "kv_tier_full" if field.startswith("kv_policy.") else "grammar_busy"
    return ApiError(429, message, field, retry_after=2, reason=reason)


def error_response(err: ApiError) -> JSONResponse:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    code = err.code or (err.reason if err.status == 429 else None)
    body = error_body(str(err), error_kind(err.status), err.param, code)
    return JSONResponse(body, status_code=err.status, headers=headers)


def cancel(streams: list[Any]) -> None:
    """Cancels replica streams still running (finished ones ignore it)."""
    for s in streams:
        try:
            s.cancel()
        except Exception:  # already finished or its replica is gone: nothing left to stop
            log.debug("stream cancel failed", exc_info=True)


async def collect(
    obs: RequestObs, body: Any, rid: str, chat: bool, streams: list, firsts: list
) -> dict[str, Any]:
    """The whole answer, once every choice has finished."""

    readers = _readers(body, firsts)

    async def drain(stream: Any, first: Delta, reader: Any) -> tuple[Delta, str]:
        """The choice's last delta (with every logprob) and its whole text."""
        text, last = first.delta_text, first
        items = first.logprobs
        while True:
            if reader is not None:
                reader.feed(last.delta_text, last.num_delta_tokens)
                if ends_at_repeat(reader, last):
                    if not last.finished:
                        cancel([stream])
                    last = repeated_end(last)
            if last.finished:
                break
            last = await stream.__anext__()
            text += last.delta_text
            if last.logprobs is not None:
                items = (items or []) + last.logprobs
        return replace(last, logprobs=items), text

    try:
        triples = zip(streams, firsts, readers, strict=True)
        drained = await asyncio.gather(*(drain(s, f, p) for s, f, p in triples))
    except Exception as exc:
        cancel(streams)
        raise ApiError(503, "the model replica failed mid-request; try again") from exc
    if down := [r for r, _ in drained if r.error_status == 503]:  # an engine went down
        raise ApiError(503, body_message(down[0].warnings[-1]), retry_after=5)
    choices = []
    results = []
    thinking = 0
    for i, (r, text) in enumerate(drained):
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if (reader := readers[i]) is not None:
                message["content"], calls = reader.result()
                if reader.thinking and reader.reasoning:
                    message["reasoning_content"] = message["reasoning"] = reader.thinking
                schema = firsts[i].answer.schema
                r = await _tool_verdict(obs, body, r, reader, schema)
                thinking += reader.thinking_tokens
                if calls:
                    message["tool_calls"] = [c.as_dict() for c in calls]
            lp = logprobs.chat(r.logprobs)
            choices.append(
                {"index": i, "message": message, "logprobs": lp, "finish_reason": r.finish_reason}
            )
        else:
            lp = logprobs.completion(r.logprobs, 0)
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": r.finish_reason}
            if r.prompt_logprobs is not None:
                choice["prompt_logprobs"] = r.prompt_logprobs
            choices.append(choice)
        obs.add_result(r)
        results.append(r)
    prompt = results[0].prompt_tokens
    completion = sum(r.completion_tokens for r in results)
    extra = {}
    if chat and results[0].prompt_logprobs is not None:  # vLLM's place for them
        extra["prompt_logprobs"] = results[0].prompt_logprobs
    return {
        **extra,
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": body.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": thinking},
        },
        "structserve": {
            "validated": [r.validated for r in results],
            "warnings": [r.warnings for r in results],
        },
    }


async def sse(
    obs: RequestObs,
    body: Any,
    rid: str,
    chat: bool,
    streams: list,
    firsts: list,
    release: Callable[[int], Awaitable[None]],
) -> AsyncIterator[str]:
    """Server-sent events as the choices stream in; `release` frees the tenant's slots at the
    end, also when the client goes away, given the tokens spent (those of choices cut short
    too: an abandoned answer is charged what it made)."""
    created = now()
    kind = "chat.completion.chunk" if chat else "text_completion"

    offsets = [0] * len(streams)  # characters of each choice already sent (text_offset)
    readers = _readers(body, firsts)

    def event(index: int, delta: Delta, choice_delta: dict[str, Any], last: bool) -> str:
        items = delta.logprobs
        reason = delta.finish_reason if last else None
        if chat:
            choice = {"index": index, "delta": choice_delta, "finish_reason": reason}
            if items is not None:
                choice["logprobs"] = logprobs.chat(items)
        else:
            choice = {"index": index, "text": delta.delta_text, "finish_reason": reason}
            if items is not None:
                choice["logprobs"] = logprobs.completion(items, offsets[index])
        obj: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": body.model}
        obj["choices"] = [choice]
        if last and delta.finished:  # like a whole response: the verdict and the warnings
            obj["structserve"] = {"validated": delta.validated, "warnings": delta.warnings}
        return "data: " + json.dumps(obj) + "\n\n"

    async def chunks(index: int, delta: Delta) -> tuple[Delta, list[str]]:
        """One event, or with tools one per content or call delta (logprobs ride the first);
        and the delta, made the last when a repeated call ends the choice here."""
        text = delta.delta_text
        reader = readers[index]
        if reader is None:
            out = [event(index, delta, {"content": text}, True)]
            offsets[index] += len(text)
            return delta, out
        parts = reader.feed(text, delta.num_delta_tokens)
        if ends_at_repeat(reader, delta):
            delta = repeated_end(delta)
        parts += reader.finish() if delta.finished else []
        if delta.finished:
            schema = firsts[index].answer.schema
            delta = await _tool_verdict(obs, body, delta, reader, schema)
        if not parts and (delta.finished or delta.logprobs is not None):
            parts = [{}]
        out = []
        for k, part in enumerate(parts):
            item = delta if k == 0 else replace(delta, logprobs=None)
            out.append(event(index, item, part, k == len(parts) - 1))
        return delta, out

    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: Any, first: Delta) -> None:
        try:
            await queue.put((index, first))
            last = first
            while not last.finished:
                last = await stream.__anext__()
                await queue.put((index, last))
        except Exception as exc:  # replica died mid-stream: the client gets an error event
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [
        asyncio.create_task(pump(i, s, f))
        for i, (s, f) in enumerate(zip(streams, firsts, strict=True))
    ]
    usage = {"prompt_tokens": firsts[0].prompt_tokens, "completion_tokens": 0}
    made = [f.completion_tokens for f in firsts]  # each choice's tokens so far
    try:
        if chat:
            for i in range(len(streams)):
                role = {"index": i, "delta": {"role": "assistant", "content": ""}}
                obj = {"id": rid, "object": kind, "created": created, "model": body.model}
                yield "data: " + json.dumps({**obj, "choices": [role]}) + "\n\n"
        open_streams, ended = len(streams), set()  # ended: choices cut short here
        while open_streams:
            index, item = await queue.get()
            if index in ended:
                continue
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                err = error_body("the model replica failed mid-stream", "server_error")
                yield "data: " + json.dumps(err) + "\n\n"
            else:
                if item.finished and item.error_status == 503:  # its engine went down
                    err = error_body(item.warnings[-1], "service_unavailable")
                    yield "data: " + json.dumps(err) + "\n\n"
                made[index] = item.completion_tokens
                last, events = await chunks(index, item)
                if last.finished:
                    usage["completion_tokens"] += last.completion_tokens
                    obs.add_result(last)
                if last.finished and not item.finished:
                    ended.add(index)
                    open_streams -= 1
                    tasks[index].cancel()
                    cancel([streams[index]])
                for e in events:
                    yield e
        await release(usage["prompt_tokens"] + sum(made))  # before the end: see Tenants.release
        if body.stream_options is not None and body.stream_options.include_usage:
            total = usage["prompt_tokens"] + usage["completion_tokens"]
            details = {"cached_tokens": firsts[0].cached_tokens}
            thinking = sum(r.thinking_tokens for r in readers if r is not None)
            usage_out = {
                **usage,
                "total_tokens": total,
                "prompt_tokens_details": details,
                "completion_tokens_details": {"reasoning_tokens": thinking},
            }
            obj = {"id": rid, "object": kind, "created": created, "model": body.model}
            yield "data: " + json.dumps({**obj, "choices": [], "usage": usage_out}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:  # also when the client goes away: stop the replicas' work too
        for t in tasks:
            t.cancel()
        cancel(streams)
        release(usage["prompt_tokens"] + sum(made))  # any other end (idempotent)
        obs.finish(200)
