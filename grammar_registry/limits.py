"""Static limits checked before any compile: cheap, exact, and named in the rejection.

xgrammar has no compile timeout and no size limits, so a hostile tenant's grammar is measured here
first. Defaults follow the published ones (llguidance's and vLLM's guards, OpenAI's
structured-output limits: 5000 properties in all, 10 levels of nesting for strict schemas, 1000 enum
values) loosened where real schemas need more; each is configurable per deployment.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from grammar_registry.specs import GrammarSpec

# `{n}`, `{n,}`, `{n,m}` in a regex or a grammar; the largest bound counts.
_COUNTED = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_BOUND_KEYWORDS = (
    "maxLength",
    "minLength",
    "maxItems",
    "minItems",
    "maxProperties",
    "minProperties",
)


class GrammarLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_spec_bytes: int = Field(default=256 << 10, ge=1)
    max_depth: int = Field(default=64, ge=1)  # nesting of the spec document itself
    max_properties: int = Field(default=5000, ge=1)  # summed over every object schema
    max_enum_values: int = Field(default=1000, ge=1)  # per enum, and choices per request
    max_total_enum_values: int = Field(default=10000, ge=1)
    max_branches: int = Field(default=64, ge=1)  # anyOf / oneOf / allOf alternatives per node
    max_regex_bytes: int = Field(default=4096, ge=1)  # one `pattern` or `regex`
    max_repeat: int = Field(default=1000, ge=1)  # largest {n,m} bound, product when nested
    max_length_bound: int = Field(default=100_000, ge=1)  # maxLength / maxItems ... values
    max_grammar_bytes: int = Field(default=64 << 10, ge=1)  # EBNF / Lark text
    max_tags: int = Field(default=64, ge=1)  # structural-tag tags / triggers
    # llguidance's parser limits (services/grammar/llguidance_backend.py). It computes
    # masks lazily, so these bound the work after admission, each mask and each token: lexer
    # fuel (~14k a ms) and Earley items (~20k a ms) per mask keep one mask near the 20 ms mask
    # budget; fuel to build the lexer's regexes (~50k a ms); lexer states a grammar may build
    # while decoding (1-2 kB each); the symbols a grammar expands to; alternatives in one row.
    # A grammar past one while decoding fails its request (422).
    mask_lexer_fuel: int = Field(default=200_000, ge=1)
    mask_parser_items: int = Field(default=50_000, ge=1)
    build_lexer_fuel: int = Field(default=1_000_000, ge=1)
    max_lexer_states: int = Field(default=250_000, ge=1)
    max_grammar_symbols: int = Field(default=500_000, ge=1)
    max_items_in_row: int = Field(default=2000, ge=1)


class LimitExceeded(ValueError):
    """A spec over a limit: carries the limit's name, the value found and the JSON path."""

    def __init__(self, limit: str, value: Any, maximum: Any, path: str = "#") -> None:
        self.limit, self.value, self.maximum, self.path = limit, value, maximum, path
        super().__init__(f"{path}: {value} exceeds the limit {limit}={maximum}")


def check_limits(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """Raises `LimitExceeded` for the first limit the spec breaks."""
    text = spec.canonical()  # one serialisation for the checks below (a big spec is costly)
    size = len(text.encode())
    if size > limits.max_spec_bytes:
        raise LimitExceeded("max_spec_bytes", size, limits.max_spec_bytes)
    if "\x00" in text or "\\u0000" in text:
        raise LimitExceeded("nul_bytes", "a NUL character", "none")
    depth = _depth(spec.source)
    if depth > limits.max_depth:
        raise LimitExceeded("max_depth", depth, limits.max_depth)
    if spec.kind == "json_schema":
        _SchemaWalk(limits).walk(spec.source, "#")
    elif spec.kind == "regex":
        _check_regex(spec.source, limits, "#")
    elif spec.kind == "choice":
        if len(spec.source) > limits.max_enum_values:
            raise LimitExceeded("max_enum_values", len(spec.source), limits.max_enum_values)
    elif spec.kind in ("ebnf", "lark"):
        if len(spec.source.encode()) > limits.max_grammar_bytes:
            raise LimitExceeded("max_grammar_bytes", len(spec.source), limits.max_grammar_bytes)
        _check_repeats(spec.source, limits, "#")
    elif spec.kind == "structural_tag":
        _check_tags(spec.source, limits)


def _depth(node: Any) -> int:
    """Nesting depth of a JSON document, without recursion (a hostile document is deep)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


def _check_regex(pattern: str, limits: GrammarLimits, path: str) -> None:
    if len(pattern.encode()) > limits.max_regex_bytes:
        raise LimitExceeded("max_regex_bytes", len(pattern.encode()), limits.max_regex_bytes, path)
    _check_repeats(pattern, limits, path)


def _check_repeats(text: str, limits: GrammarLimits, path: str) -> None:
    """The largest counted repetition, multiplied through enclosing groups: `(.{0,50}){0,50}`
    is 2500 repetitions of `.`, the shape whose masks cost xgrammar the most."""
    worst = _nested_repeat(text)
    if worst > limits.max_repeat:
        raise LimitExceeded("max_repeat", worst, limits.max_repeat, path)


def _nested_repeat(text: str) -> int:
    # Each group's inner bound is the largest product seen inside it; a bound right after the
    # closing parenthesis multiplies it.
    stack: list[int] = [1]
    worst, i = 1, 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":  # a character class: its parentheses and braces are literals
            i = _class_end(text, i) + 1
            continue
        if ch == "(":
            stack.append(1)
        elif ch == ")" and len(stack) > 1:
            inner = stack.pop()
            bound = _bound_at(text, i + 1)
            stack[-1] = max(stack[-1], inner * bound)
        elif ch == "{":
            stack[-1] = max(stack[-1], _bound_at(text, i))
        worst = max(worst, *stack)
        i += 1
    return worst


def _class_end(text: str, i: int) -> int:
    j = i + 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j


def _bound_at(text: str, i: int) -> int:
    m = _COUNTED.match(text, i)
    if not m:
        return 1
    low, high = int(m.group(1)), m.group(2)
    return max(low, int(high) if high else low)


class _SchemaWalk:
    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self.properties = 0
        self.enum_values = 0

    def walk(self, node: Any, path: str) -> None:
        # Iterative: the depth limit already bounds it, but a stack never overflows.
        stack = [(node, path)]
        while stack:
            item, where = stack.pop()
            if isinstance(item, dict):
                self._node(item, where)
                stack.extend((v, f"{where}/{k}") for k, v in item.items())
            elif isinstance(item, list):
                stack.extend((v, f"{where}/{i}") for i, v in enumerate(item))

    def _node(self, node: dict[str, Any], path: str) -> None:
        lim = self.limits
        props = node.get("properties")
        if isinstance(props, dict):
            self.properties += len(props)
            if self.properties > lim.max_properties:
                raise LimitExceeded("max_properties", self.properties, lim.max_properties, path)
        for key in ("enum",):
            values = node.get(key)
            if isinstance(values, list):
                if len(values) > lim.max_enum_values:
                    raise LimitExceeded("max_enum_values", len(values), lim.max_enum_values, path)
                self.enum_values += len(values)
                if self.enum_values > lim.max_total_enum_values:
                    raise LimitExceeded(
                        "max_total_enum_values", self.enum_values, lim.max_total_enum_values, path
                    )
        for key in ("anyOf", "oneOf", "allOf"):
            branches = node.get(key)
            if isinstance(branches, list) and len(branches) > lim.max_branches:
                where = f"{path}/{key}"
                raise LimitExceeded("max_branches", len(branches), lim.max_branches, where)
        for key in _BOUND_KEYWORDS:
            value = node.get(key)
            if isinstance(value, int | float) and value > lim.max_length_bound:
                where = f"{path}/{key}"
                raise LimitExceeded("max_length_bound", value, lim.max_length_bound, where)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            _check_regex(pattern, lim, f"{path}/pattern")
        pattern_props = node.get("patternProperties")
        if isinstance(pattern_props, dict):
            for name in pattern_props:
                _check_regex(name, lim, f"{path}/patternProperties")


def _check_tags(tag: dict[str, Any], limits: GrammarLimits) -> None:
    count = len(tag.get("structures", []) or []) + len(tag.get("triggers", []) or [])
    fmt = tag.get("format")
    if isinstance(fmt, dict):
        count += _count_tag_nodes(fmt)
    if count > limits.max_tags:
        raise LimitExceeded("max_tags", count, limits.max_tags)
    _check_tag_contents(tag, limits)


def _check_tag_contents(tag: dict[str, Any], limits: GrammarLimits) -> None:
    """The schemas and patterns inside a tag (tool arguments...) meet the limits their own
    kinds do (counted over the whole tag): a tag is no way around them."""
    schemas = _SchemaWalk(limits)
    stack: list[tuple[Any, str]] = [(tag, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((x, f"{path}/{i}") for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind == "json_schema" and isinstance(node.get("json_schema"), dict):
            schemas.walk(node["json_schema"], f"{path}/json_schema")
        elif "schema" in node and isinstance(node["schema"], dict):  # vLLM's older structures
            schemas.walk(node["schema"], f"{path}/schema")
        elif kind == "regex" and isinstance(node.get("pattern"), str):
            _check_regex(node["pattern"], limits, f"{path}/pattern")
        else:
            stack.extend((v, f"{path}/{k}") for k, v in node.items())


def _count_tag_nodes(fmt: dict[str, Any]) -> int:
    """Tags inside xgrammar's structural-tag `format` tree (`tags`, `elements`, `triggers`)."""
    count, stack = 0, [fmt]
    while stack:
        node = stack.pop()
        for key in ("tags", "elements", "triggers"):
            items = node.get(key)
            if isinstance(items, list):
                count += len(items)
                stack.extend(x for x in items if isinstance(x, dict))
        for value in node.values():
            if isinstance(value, dict):
                stack.append(value)
    return count
