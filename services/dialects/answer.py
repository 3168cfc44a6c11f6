"""An answer in the message's terms: reasoning, content and whole calls, read by walking the
grammar that made it (split.py); `Splitter` reads it as it streams, `split` whole, and what the
first returns, concatenated, is what the second does."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from services.dialects.split import Span, arguments, walk


@dataclass
class Call:
    name: str
    arguments: str  # JSON text


@dataclass
class Answer:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)  # calls the text ended inside (max_tokens)


def answer_of(spans: list[Span], names: list[str]) -> Answer:
    """Spans in the message's terms: thinking blocks are reasoning (harmony's `final`
    channel is content), free text is content, whole calls are calls."""
    out = Answer()
    for s in spans:
        if s.kind == "block":
            if "final" in (s.tag or {}).get("begin", ""):
                out.content += s.text
            else:
                out.reasoning += s.text
        elif s.kind in ("text", "args"):  # free text, or the response format's JSON
            out.content += s.text
        elif s.done:
            out.calls.append(Call(name_of(s.tag or {}, names), arguments(s)))
        else:
            out.cut.append(name_of(s.tag or {}, names) or "a call")
    out.reasoning, out.content = out.reasoning.strip(), out.content.strip()
    return out


def name_of(tag: dict[str, Any], names: list[str]) -> str:
    """The tool a call's tag is for: the longest tool name its literal text holds (its
    `begin`, or a constant inside it: Cohere's and Kimi's ids come before the name)."""
    content = tag.get("content", {})
    consts = [e.get("value", "") for e in content.get("elements", []) if isinstance(e, dict)]
    literal = " ".join([tag.get("begin", ""), *consts])
    found = [n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w.-])", literal)]
    return max(found, key=len) if found else ""


class Splitter:
    """A streamed answer, read as it grows: `feed` returns what is new since the last call:
    reasoning and content text, and each call once whole. `finish` returns the rest; what was
    returned, concatenated, is `split(...)` of the whole text, by construction: each partial
    walk gives prefixes of the final one (split.py holds back what could begin a marker)."""

    def __init__(self, tag: dict[str, Any], names: list[str]) -> None:
        self.tag, self.names, self.text = tag, names, ""
        self.sent = Answer()

    def feed(self, delta: str, final: bool = False) -> Answer:
        self.text += delta
        now = answer_of(walk(self.tag, self.text, final), self.names)
        new = Answer(
            reasoning=now.reasoning[len(self.sent.reasoning) :],
            content=now.content[len(self.sent.content) :],
            calls=now.calls[len(self.sent.calls) :],
            cut=now.cut if final else [],
        )
        self.sent.reasoning += new.reasoning
        self.sent.content += new.content
        self.sent.calls += new.calls
        return new

    def finish(self) -> Answer:
        return self.feed("", final=True)


def split(tag: dict[str, Any], text: str, names: list[str]) -> Answer:
    """A whole answer (final: free text that could begin a marker is text)."""
    return answer_of(walk(tag, text, final=True), names)
