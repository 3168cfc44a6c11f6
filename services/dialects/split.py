"""An answer split back into reasoning, content and tool calls by walking the grammar that made it.

The structural tag a request is constrained by (xgrammar's format tree: `sequence`, `tag`,
`triggered_tags`, `tags_with_separator`, `any_text`, `json_schema`, ...) says where the thinking
block, the free text and each call sit. The same tree read over the output text gives them back,
so no dialect needs a parser of its own: what a dialect differs in is data (its markers, its
arguments' style), not code.

`walk(fmt, text, final)` returns the spans in order. With `final=False` the text may still grow:
the walk stops where the text ends, and free text that could be the start of a marker is held
back, so every span it returns is a prefix of what the finished text gives (streamed deltas
concatenate to the whole answer by construction). An `any_text` inside a tag ends at the tag's
end marker; `json_schema` content in JSON style is one JSON value; other styles (XML arguments)
run to the tag's end and are converted by `arguments`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_decoder = json.JSONDecoder()


@dataclass
class Span:
    """`kind`: "text" (free text between calls), "block" (a tag's free text: the thinking
    block, or harmony's final channel), "call" (a tag with arguments). `tag`: the tag it came
    from (its `begin` names the call). `done`: the span is whole (a call can only be sent so)."""

    kind: str
    text: str
    tag: dict[str, Any] | None = None
    style: str = "json"
    schema: Any = None
    done: bool = True


@dataclass
class _Cut(Exception):
    """The text ended inside a format: the spans so far (the last may be open)."""

    spans: list[Span]


def walk(fmt: dict[str, Any], text: str, final: bool = True) -> list[Span]:
    """The spans of `text` under `fmt` (a structural tag or its `format`). Text the format does
    not account for (an unconstrained answer that wandered off) comes back as free text."""
    fmt = fmt.get("format", fmt) if fmt.get("type") == "structural_tag" else fmt
    walker = _Walker(text, final)
    try:
        for end, spans in walker.match(fmt, 0, None):
            if end == len(text):
                return _merged(spans)
        best = next(walker.match(fmt, 0, None), (0, []))
    except _Cut as cut:
        return _merged(cut.spans)
    end, spans = best
    rest = text[end:]
    return _merged([*spans, Span("text", rest)] if rest else spans)


def _merged(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for s in spans:
        if s.kind == "text" and not s.text:
            continue
        if out and s.kind == "text" and out[-1].kind == "text":
            out[-1] = Span("text", out[-1].text + s.text, done=s.done)
        else:
            out.append(s)
    return out


def _ends(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _held(text: str, markers: list[str]) -> int:
    """How many trailing characters of `text` could begin one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


class _Walker:
    def __init__(self, text: str, final: bool) -> None:
        self.text, self.final = text, final

    def match(
        self, fmt: dict[str, Any], pos: int, stop: list[str] | None
    ) -> Iterator[tuple[int, list[Span]]]:
        """Every way `fmt` matches from `pos`: (end, spans). `stop`: the enclosing tag's end
        markers, where free text ends. Raises _Cut when the (growing) text ends inside."""
        kind = fmt.get("type")
        handler = getattr(self, f"_{kind}", None)
        if handler is None:
            raise ValueError(f"structural tag format {kind!r} is not read back")
        yield from handler(fmt, pos, stop)

    def _literal(self, value: str, pos: int) -> Iterator[int]:
        text = self.text
        if text.startswith(value, pos):
            yield pos + len(value)
        elif value.startswith(text[pos:]):  # the text ended inside it
            raise _Cut([])

    def _const_string(self, fmt: dict, pos: int, stop: Any) -> Iterator[tuple[int, list[Span]]]:
        for end in self._literal(fmt["value"], pos):
            yield end, []

    def _regex(self, fmt: dict, pos: int, stop: Any) -> Iterator[tuple[int, list[Span]]]:
        found = re.compile(fmt["pattern"]).match(self.text, pos)
        if found and (found.end() < len(self.text) or self.final):
            yield found.end(), []
        elif not self.final and pos <= len(self.text):
            raise _Cut([])

    def _any_text(self, fmt: dict, pos: int, stop: list[str] | None) -> Iterator[tuple[int, list]]:
        text = self.text
        hits = [at for at in (text.find(s, pos) for s in stop or []) if at >= 0]
        if hits:
            end = min(hits)
            yield end, [Span("text", text[pos:end])]
            return
        if stop is None:  # free text to the end
            yield len(text), [Span("text", text[pos:])]
            return
        keep = 0 if self.final else _held(text[pos:], stop)
        raise _Cut([Span("text", text[pos : len(text) - keep], done=False)])

    def _json_schema(self, fmt: dict, pos: int, stop: list[str] | None) -> Iterator[tuple]:
        text, style = self.text, fmt.get("style", "json")
        if style == "json":
            try:
                _, end = _decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):  # under the grammar: the text ended inside
                raise _Cut([]) from None
            yield end, [Span("args", text[pos:end], style=style, schema=fmt.get("json_schema"))]
            return
        hits = [at for at in (text.find(s, pos) for s in stop or []) if at >= 0]
        if not hits:
            raise _Cut([])
        end = min(hits)
        yield end, [Span("args", text[pos:end], style=style, schema=fmt.get("json_schema"))]

    def _sequence(self, fmt: dict, pos: int, stop: Any) -> Iterator[tuple[int, list[Span]]]:
        yield from self._chain(fmt["elements"], pos, stop, [])

    def _chain(self, elements: list, pos: int, stop: Any, spans: list) -> Iterator[tuple]:
        if not elements:
            yield pos, spans
            return
        last = len(elements) == 1
        try:
            for end, found in self.match(elements[0], pos, stop if last else None):
                yield from self._chain(elements[1:], end, stop, spans + found)
        except _Cut as cut:
            raise _Cut(spans + cut.spans) from None

    def _or(self, fmt: dict, pos: int, stop: Any) -> Iterator[tuple[int, list[Span]]]:
        for element in fmt["elements"]:
            yield from self.match(element, pos, stop)

    def _optional(self, fmt: dict, pos: int, stop: Any) -> Iterator[tuple[int, list[Span]]]:
        try:
            yield from self.match(fmt["content"], pos, stop)
        except _Cut:
            if pos < len(self.text):
                raise
        yield pos, []

    def _tag(self, fmt: dict, pos: int, stop: Any) -> Iterator[tuple[int, list[Span]]]:
        ends = _ends(fmt["end"])
        try:  # a cut anywhere in it, its begin included, leaves the tag open
            for start in self._literal(fmt["begin"], pos):
                for inner_end, inner in self.match(fmt["content"], start, ends):
                    for marker in ends:
                        for end in self._literal(marker, inner_end):
                            yield end, self._spans(fmt, inner)
        except _Cut as cut:
            raise _Cut(self._spans(fmt, cut.spans, done=False)) from None

    @staticmethod
    def _spans(fmt: dict, inner: list[Span], done: bool = True) -> list[Span]:
        """A tag's spans: a call (its content holds arguments), the tags nested in it (a
        section of calls), or a block of free text."""
        if any(s.kind in ("call", "block") for s in inner) or _holds(fmt["content"], _TAGGED):
            return inner
        if _holds(fmt["content"], ("json_schema",)):
            args = next((s for s in inner if s.kind == "args"), Span("args", ""))
            return [Span("call", args.text, fmt, args.style, args.schema, done=done)]
        text = "".join(s.text for s in inner if s.kind == "text")
        return [Span("block", text, tag=fmt, done=done)]

    def _tags(self, fmt: dict, pos: int) -> Iterator[tuple[int, list[Span]]]:
        for tag in fmt["tags"]:
            yield from self.match(tag, pos, None)

    def _triggered_tags(self, fmt: dict, pos: int, stop: Any) -> Iterator[tuple]:
        """Free text, and a tag wherever one of the triggers starts one."""
        text, calls = self.text, 0
        spans: list[Span] = []
        once = fmt.get("stop_after_first", False)
        while True:
            hits = [(at, t) for t in fmt["triggers"] if (at := text.find(t, pos)) >= 0]
            ends = [at for at in (text.find(s, pos) for s in stop or []) if at >= 0]
            limit = min(ends) if ends else len(text)
            hits = [(at, t) for at, t in hits if at < limit]
            if (once and calls) or not hits:
                if not self.final and not ends:
                    keep = _held(text[pos:], [*fmt["triggers"], *(stop or [])])
                    free = Span("text", text[pos : len(text) - keep], done=False)
                    raise _Cut([*spans, free])
                yield limit, [*spans, Span("text", text[pos:limit])]
                return
            at = min(a for a, _ in hits)
            spans = [*spans, Span("text", text[pos:at])]
            try:
                found = next(self._tags(fmt, at), None)
            except _Cut as cut:
                raise _Cut(spans + cut.spans) from None
            if found is None:  # a trigger the tags do not follow: text
                spans.append(Span("text", text[at : at + 1]))
                pos = at + 1
                continue
            pos, tag_spans = found
            spans += tag_spans
            calls += 1

    def _tags_with_separator(self, fmt: dict, pos: int, stop: Any) -> Iterator[tuple]:
        spans: list[Span] = []
        once = fmt.get("stop_after_first", False)
        if not fmt.get("at_least_one", False) and (
            pos == len(self.text) or self._next_is_end(pos, stop)
        ):
            yield pos, []
            return
        while True:
            try:
                found = next(self._tags(fmt, pos), None)
            except _Cut as cut:
                raise _Cut(spans + cut.spans) from None
            if found is None:
                if spans:
                    yield pos, spans
                return
            pos, tag_spans = found
            spans += tag_spans
            sep = fmt.get("separator", "")
            rest = self.text[pos:]
            if sep and len(rest) < len(sep) and sep.startswith(rest) and not once:
                raise _Cut(spans)  # the text ended inside the separator
            if once or not self.text.startswith(sep, pos) or self._next_is_end(pos, stop):
                yield pos, spans
                return
            if sep == "" and pos == len(self.text):
                yield pos, spans
                return
            pos += len(sep)

    def _next_is_end(self, pos: int, stop: list[str] | None) -> bool:
        return bool(stop) and any(self.text.startswith(s, pos) for s in stop or [])


_TAGGED = ("tag", "triggered_tags", "tags_with_separator")


def _holds(fmt: Any, kinds: tuple[str, ...]) -> bool:
    """Whether a format has one of `kinds` in it, outside nested tags."""
    if not isinstance(fmt, dict):
        return False
    if fmt.get("type") in kinds:
        return True
    if fmt.get("type") in _TAGGED:
        return False
    return any(_holds(f, kinds) for f in [fmt.get("content"), *fmt.get("elements", [])])


def arguments(span: Span) -> str:
    """A call's arguments as OpenAI sends them: JSON text (as written, in the JSON style)."""
    if span.style == "json":
        return span.text
    if span.style == "qwen_xml":
        pairs = re.findall(r"<parameter=([^>\n]+)>(.*?)</parameter>", span.text, re.S)
    elif span.style == "glm_xml":
        pairs = re.findall(
            r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", span.text, re.S
        )
    else:
        raise ValueError(f"arguments in the {span.style!r} style are not read back")
    props = (span.schema or {}).get("properties", {}) if isinstance(span.schema, dict) else {}
    return json.dumps({k.strip(): _value(v.strip(), props.get(k.strip())) for k, v in pairs})


def _value(raw: str, schema: Any) -> Any:
    """An XML argument's value (the whitespace around it is layout: the grammar lets a model
    write any there): a string where the schema says string, else the JSON it holds."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw
