"""The hostile corpus: requests a tenant can send to hurt the others, each with what must happen.

Shared by the engine-level containment tests, the HTTP ones and `benchmarks/containment.py`.
`expect` is a piece of the reason the request must fail with; None means the request must be
served normally (its numerics are sane, its trap is defused). `params` are `SamplingParams`
fields, `structured` `StructuredOutput` fields; `http` is the same request as a body fragment of
a chat completion (None: it has no HTTP form worth sending, e.g. engine-only parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# 61 forced characters, then masks of ~0.5 s and more (20 ms is the budget): a probe that timed
# the first steps only saw the cheap forced ones; it must walk past the forced text
SLOW_MASK_REGEX = '"' + "abcdefghij" * 6 + "(.{0,8}){0,8}"
# the same trap with a shorter fuse: first mask ~0.15 s, then cheap ones, so a probe's median can
# pass it and the decode-time budget must catch it
SLOW_ONCE_REGEX = '"' + "abcdefghij" * 6 + "(.{0,4}){0,4}"
# cheap masks for 12 choice points, then ~5 s of CPU per mask; and the same in a branch few
# tokens enter (a request steers there with logit_bias): the probe must walk deep and rare
SLOW_PAST_CHOICES = r"([ab]\n){12}(.?){0,1000}"
SLOW_IN_RARE_BRANCH = r"(c[a-y ]{0,40}|zqxjv(.?){0,1000})"
# Python's `re` needs ~2^24 steps to refuse `(a+)+$` on 24 a's and a '!'
CATASTROPHIC = {"type": "string", "pattern": "^a{24}!$", "not": {"pattern": "^(a+)+$"}}
UNRESOLVABLE = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
    "not": {"$ref": "#/$defs/missing"},
}
QUESTION = "Is the sky blue? Answer briefly."
ALMOST = "word " * 200  # 1000 characters a streamed text keeps nearly matching


def slow_compile_schema(branches: int = 64, parts: int = 1, bound: int = 1000) -> dict[str, Any]:
    """Within the static limits and slow to compile: about 2.5 s per 60 branches and part for
    SmolLM2's vocabulary on 2 cores (3 parts of 60: ~7 s, past most compile deadlines)."""
    words = {"type": "string", "pattern": "[a-z]{1," + str(bound) + "}"}
    one = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": words}, "required": [f"k{i}"]}
            for i in range(branches)
        ]
    }
    if parts == 1:
        return one
    names = [f"p{i}" for i in range(parts)]
    return {"type": "object", "properties": {n: one for n in names}, "required": names}


def _nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "array"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


DEEP = _nested_arrays(80)  # over the static limit on nesting (64)


def chained_if_then(n: int = 31) -> dict[str, Any]:
    """Within every static limit (2.4 KB at n=31): a short string to xgrammar, which ignores
    `if`/`then`; to a validator, each level's `if` and `then` both name the next `$defs` entry,
    so validating an output visits 2^n subschemas holding the GIL (~45 s at n=31; each further
    level doubles it)."""

    def both(i: int) -> dict[str, Any]:
        return {"if": {"$ref": f"#/$defs/d{i}"}, "then": {"$ref": f"#/$defs/d{i}"}}

    defs = {f"d{i}": both(i + 1) for i in range(1, n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "string", "maxLength": 6, "$defs": defs, **both(1)}


FREEZER = chained_if_then()


@dataclass(frozen=True)
class Case:
    name: str
    group: str  # numerics | schema | regex | stop | prompt | tools
    expect: str | None
    params: dict[str, Any] = field(default_factory=dict)
    structured: dict[str, Any] | None = None
    prompt: str | list[int] | None = None  # None: a short chat question
    http: dict[str, Any] | None = None
    validated: bool | None = None  # served cases with a schema: the verdict expected
    # grammar backend -> `expect` where it differs from xgrammar's (auto follows xgrammar for
    # regexes and tags, so only llguidance differs)
    by_backend: dict[str, str | None] = field(default_factory=dict)

    def expected(self, backend: str = "xgrammar") -> str | None:
        return self.by_backend.get(backend, self.expect)


CASES = [
    Case("tiny_temperature", "numerics", None, {"temperature": 1e-39}, http={"temperature": 1e-39}),
    Case(
        "tiny_top_p",
        "numerics",
        None,
        {"temperature": 1.0, "top_p": 1e-12, "seed": 1},
        http={"top_p": 1e-12},
    ),
    Case(  # found by the HTTP fuzz: rounds to 0 in float32, which once cut every token
        "denormal_top_p",
        "numerics",
        None,
        {"temperature": 1.0, "top_p": 5e-324, "seed": 4},
        http={"top_p": 5e-324},
    ),
    Case("top_k_minus_one", "numerics", None, {"temperature": 1.0, "top_k": -1, "seed": 2}),
    Case(
        "huge_logit_bias",
        "numerics",
        None,
        {"temperature": 1.0, "seed": 5, "logit_bias": {t: 100.0 for t in range(1024)}},
        http={"logit_bias": {str(t): 100 for t in range(1024)}},
    ),
    Case(
        "extreme_penalties",
        "numerics",
        None,
        {"repetition_penalty": 1e30, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        http={"repetition_penalty": 100, "presence_penalty": -2, "frequency_penalty": 2},
    ),
    Case(
        "min_tokens_at_max_with_every_logprob",
        "numerics",
        None,
        {"min_tokens": 32, "logprobs": 20},
        http={"min_tokens": 32, "logprobs": True, "top_logprobs": 20},
    ),
    Case("min_p_one", "numerics", None, {"temperature": 1.0, "min_p": 1.0, "seed": 3}),
    Case(
        "huge_seed",
        "numerics",
        None,
        {"temperature": 1.0, "seed": 2**64 - 1},
        http={"seed": 2**63 - 1},
    ),
    Case(
        "huge_max_tokens",
        "numerics",
        "max_tokens",
        {"max_tokens": 10**9},
        http={"max_tokens": 10**9},
    ),
    Case(
        "unresolvable_ref",
        "schema",
        "schema could not be used to validate",
        structured={"json_schema": UNRESOLVABLE},
        http={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": UNRESOLVABLE},
            }
        },
    ),
    Case(
        "catastrophic_not_pattern",
        "schema",
        None,
        structured={"json_schema": CATASTROPHIC},
        validated=True,
        http={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": CATASTROPHIC},
            }
        },
    ),
    Case(
        "deep_schema",
        "schema",
        "max_depth",
        structured={"json_schema": DEEP},
        http={
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}
        },
    ),
    Case(
        "repeat_bomb",
        "regex",
        "max_repeat",
        structured={"regex": "(.{0,50}){0,50}"},
        http={"structured_outputs": {"regex": "(.{0,50}){0,50}"}},
    ),
    Case(
        "invalid_regex",
        "regex",
        "structured.regex",
        structured={"regex": "(("},
        http={"structured_outputs": {"regex": "(("}},
    ),
    Case(  # llguidance computes these masks lazily in well under the budget: served
        "slow_mask_behind_forced_prefix",
        "regex",
        "mask",
        structured={"regex": SLOW_MASK_REGEX},
        http={"structured_outputs": {"regex": SLOW_MASK_REGEX}},
        by_backend={"llguidance": None},
    ),
    Case(
        "slow_mask_past_choice_points",
        "regex",
        "a mask takes",
        structured={"regex": SLOW_PAST_CHOICES},
        http={"structured_outputs": {"regex": SLOW_PAST_CHOICES}},
        by_backend={"llguidance": None},
    ),
    Case(
        "slow_mask_in_a_rare_branch",
        "regex",
        "a mask takes",
        structured={"regex": SLOW_IN_RARE_BRANCH},
        http={"structured_outputs": {"regex": SLOW_IN_RARE_BRANCH}},
        by_backend={"llguidance": None},
    ),
    Case(
        "huge_stop_strings",
        "stop",
        "stop",
        {"stop": ["x" * 20000] * 4},
        http={"stop": ["x" * 20000] * 4},
    ),
    Case(
        "too_many_stop_strings",
        "stop",
        "stop",
        {"stop": [f"s{i}" for i in range(17)]},
        http={"stop": [f"s{i}" for i in range(5)]},
    ),
    Case(
        "long_stop_strings_nearly_matching",
        "stop",
        None,
        {"stop": [ALMOST + str(i) for i in range(16)], "ignore_eos": True},
        prompt="Repeat the word 'word' forever: word word word word word",
        http={"stop": [ALMOST + str(i) for i in range(4)]},
    ),
    Case(
        "huge_text_prompt",
        "prompt",
        "characters exceed",
        prompt="a " * 2_000_000,
        http={"messages": [{"role": "user", "content": "a " * 1_500_000}]},
    ),
    Case("huge_token_prompt", "prompt", "max_tokens: prompt", prompt=[1] * 2_000_000, http=None),
    Case("token_outside_vocabulary", "prompt", "vocabulary", prompt=[10**9], http=None),
]


def _function(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _tools_case(name: str, expect: str | None, tools: list[dict[str, Any]]) -> Case:
    """Hostile tools: the engine gets the structural tag the ingress builds from them (xgrammar's
    format: llguidance refuses it by name, after the static limits)."""
    from deployments import tools as tool_calls
    from deployments.protocol import ChatCompletionRequest

    http = {"tools": tools, "tool_choice": "required"}
    ask = [{"role": "user", "content": QUESTION}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ask, **http})
    tag = tool_calls.structural_tag(body)
    by_backend = {"llguidance": expect or "not supported by the llguidance backend"}
    return Case(
        name, "tools", expect, structured={"structural_tag": tag}, http=http, by_backend=by_backend
    )


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


CASES += [
    # the tag's schemas meet the limits a schema of their own does
    _tools_case(
        "tool_repeat_bomb",
        "max_repeat",
        [_function("f", _object(s={"type": "string", "pattern": "(.{0,50}){0,50}"}))],
    ),
    _tools_case("tool_deep_parameters", "max_depth", [_function("f", _object(x=DEEP))]),
    _tools_case(  # (no parameters: the prompt that lists them still fits the context)
        "too_many_tools",
        "max_tags",
        [{"type": "function", "function": {"name": f"f{i}"}} for i in range(70)],
    ),
    # validated off the loop in linear time (the ingress validates tool arguments itself)
    _tools_case("tool_catastrophic_pattern", None, [_function("f", _object(s=CATASTROPHIC))]),
]
BY_NAME = {c.name: c for c in CASES}


def engine_request(case: Case, engine: Any, **defaults: Any) -> tuple[Any, Any]:
    """The case as `(prompt, SamplingParams)` for `engine`: its own parameters over `defaults`
    (greedy unless it says otherwise), a short chat question unless it brings a prompt.
    Raises `ValueError` for parameters refused before any work."""
    from services import SamplingParams, StructuredOutput

    params = {"temperature": 0.0, **defaults, **case.params}
    if case.structured is not None:
        params["structured"] = StructuredOutput(**case.structured)
    prompt = case.prompt
    if prompt is None:
        prompt = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
    return prompt, SamplingParams(**params)
