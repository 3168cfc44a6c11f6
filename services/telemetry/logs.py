"""JSON logs: one object per line, with the request id, tenant and trace id.

The ingress binds `request_id` and `tenant` for the length of a request (`log_context`); the
current OpenTelemetry span gives `trace_id` and `span_id`. A record's `extra` fields are written
too, except prompt text (`prompt`, `messages`, `completion`), which only `log_prompts` lets
through. Bearer credentials and `api_key=...` values are masked in every message and field: the
service never logs a key, even one a client put where it does not belong.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any

from opentelemetry import trace

PACKAGES = ("deployments", "services", "grammar_registry", "kvcache")
PROMPT_FIELDS = frozenset({"prompt", "messages", "completion"})
_SECRET = re.compile(r"(?i)(bearer\s+|api[_-]?key[\"']?\s*[=:]\s*[\"']?)[^\s\"',;]+")
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_CONTEXT: ContextVar[dict[str, Any] | None] = ContextVar("structserve_log_context", default=None)


def redact(text: str) -> str:
    return _SECRET.sub(lambda m: m.group(1) + "[redacted]", text)


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Adds `fields` (request_id, tenant, ...) to every record logged inside the block."""
    token = _CONTEXT.set({**(_CONTEXT.get() or {}), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def bind(**fields: Any) -> None:
    """Adds `fields` to the current context until it ends (an asyncio task: its request)."""
    _CONTEXT.set({**(_CONTEXT.get() or {}), **fields})


class JsonFormatter(logging.Formatter):
    def __init__(self, log_prompts: bool = False) -> None:
        super().__init__()
        self.log_prompts = log_prompts

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        out.update(_CONTEXT.get() or {})
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out.setdefault("trace_id", format(ctx.trace_id, "032x"))
            out.setdefault("span_id", format(ctx.span_id, "016x"))
        for key, value in vars(record).items():
            if key in _STANDARD or key.startswith("_"):
                continue
            if key in PROMPT_FIELDS and not self.log_prompts:
                continue
            out[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(out, default=str)


class JsonHandler(logging.StreamHandler):
    """The handler `install` puts on the project's loggers (a class, so it is found again)."""


def install(log_prompts: bool = False, level: str = "INFO", stream: IO[str] | None = None) -> None:
    """JSON lines on `stream` (stderr) for the project's loggers; replaces an earlier install.
    The loggers stop propagating, so no other handler prints the same record unredacted."""
    handler = JsonHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(log_prompts))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, JsonHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def uninstall() -> None:
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, JsonHandler)]:
            logger.removeHandler(old)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
