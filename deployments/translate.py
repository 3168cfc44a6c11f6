"""From an HTTP body to the engine's `SamplingParams` and `StructuredOutput`.

One way of constraining the output per request, whichever name the client uses for it:
`response_format` (OpenAI), `structured_outputs` (vLLM), `grammar_id` (ours), and the aliases
older vLLM clients and SGLang still send (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`; `json_schema`, `regex`, `ebnf`), and `tools` unless `tool_choice` is
`"none"` (deployments/tools.py). Two at once is a 400 naming both.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deployments import tools
from deployments.protocol import BadRequest, body_message
from grammar_registry.limits import GrammarLimits, LimitExceeded, check_limits
from services.engine.params import KVPolicy, SamplingParams
from services.grammar.backend import GrammarError, load_json_text
from services.grammar.canonical import to_spec
from services.grammar.structured import StructuredOutput

_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")
# alias field -> the StructuredOutput kind it means
_ALIASES = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json_schema",  # SGLang's, a JSON string or an object
    "regex": "regex",
    "ebnf": "grammar",
}


def xgrammar_tag(value: dict[str, Any]) -> dict[str, Any]:
    """xgrammar's structural tag, from its own shape (`format`) or vLLM's older one
    (`structures` of begin/schema/end, and `triggers`)."""
    if "format" in value or "structures" not in value:
        return {"type": "structural_tag", "format": value.get("format", value)}
    tags = [
        {
            "type": "tag",
            "begin": s.get("begin", ""),
            "content": {"type": "json_schema", "json_schema": s.get("schema", {})},
            "end": s.get("end", ""),
        }
        for s in value["structures"]
    ]
    triggers = value.get("triggers") or []
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return {"type": "structural_tag", "format": fmt}


def _response_format(body: Any) -> dict[str, Any] | None:
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        return {"json_object": True}
    if rf is not None and rf.type == "structural_tag":
        return {"structural_tag": rf.model_dump(include={"format", "structures", "triggers"})}
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        return {"json_schema": rf.json_schema.schema_, "strict": rf.json_schema.strict is not False}
    return None


_ONE_KIND = (
    "structured_outputs: set exactly one of json, regex, choice, grammar, structural_tag, "
    "grammar_id"
)


def _structured_kind(body: Any) -> dict[str, Any] | None:
    """The constraint `structured_outputs` names, if it names one."""
    so = body.structured_outputs
    if so is None:
        return None
    kinds = {
        "json_schema": so.json_,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "structural_tag": so.structural_tag,
        "grammar_id": so.grammar_id,
    }
    given = {k: v for k, v in kinds.items() if v is not None}
    if len(given) > 1:
        raise BadRequest(_ONE_KIND, "structured_outputs")
    return given or None


def _structured_options(body: Any) -> dict[str, Any]:
    """`structured_outputs`' options, explicitly set ones only: they apply to the constraint it
    names, or, naming none, to the request's other one (`response_format`, tools, the aliases),
    so a client's `response_format` can still pin a backend."""
    so = body.structured_outputs
    if so is None:
        return {}
    if so.whitespace_pattern is not None:
        raise BadRequest(
            "structured_outputs.whitespace_pattern: not supported (use disable_any_whitespace)",
            "structured_outputs.whitespace_pattern",
        )
    options: dict[str, Any] = {}
    if so.disable_any_whitespace:
        options["compact"] = True
    if so.disable_additional_properties:
        options["strict"] = True  # xgrammar's strict mode: no properties the schema does not list
    for name in ("bound_numbers", "max_repeat_run", "backend"):
        if name in so.model_fields_set:
            options[name] = getattr(so, name)
    return options


def _chosen(body: Any) -> list[tuple[str, dict[str, Any]]]:
    chosen = []
    if getattr(body, "tools", None) and (tag := tools.structural_tag(body)) is not None:
        chosen.append(("tools", {"structural_tag": tag}))
    if (rf := _response_format(body)) is not None:
        chosen.append(("response_format", rf))
    if (so := _structured_kind(body)) is not None:
        chosen.append(("structured_outputs", so))
    if getattr(body, "grammar_id", None) is not None:
        chosen.append(("grammar_id", {"grammar_id": body.grammar_id}))
    for field, kind in _ALIASES.items():
        value = getattr(body, field, None)
        if value is not None:
            chosen.append((field, {kind: value}))
    return chosen


def structured_from(body: Any) -> StructuredOutput | None:
    """At most one way of constraining the output (a completion request, or a grammar
    registration, which has neither `grammar_id` nor the aliases)."""
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        field = "guided_whitespace_pattern"
        raise BadRequest(f"{field}: not supported (use disable_any_whitespace)", field)
    chosen = _chosen(body)
    options = _structured_options(body) if hasattr(body, "structured_outputs") else {}
    if not chosen:
        if getattr(body, "structured_outputs", None) is not None:
            raise BadRequest(_ONE_KIND, "structured_outputs")  # options with nothing to apply to
        return None
    if len(chosen) > 1:
        names = ", ".join(name for name, _ in chosen)
        raise BadRequest(f"{names}: give one way of constraining the output", chosen[1][0])
    field, kwargs = chosen[0]
    kwargs = {**kwargs, **options}
    tag = kwargs.get("structural_tag")
    if isinstance(tag, str):  # (vLLM sends it as a JSON string)
        try:
            tag = load_json_text(tag, "structural_tag")
        except GrammarError as exc:
            raise BadRequest(str(exc), field) from exc
    if tag is not None:
        if not isinstance(tag, dict):
            raise BadRequest("structural_tag: must be a JSON object", field)
        kwargs["structural_tag"] = xgrammar_tag({k: v for k, v in tag.items() if v is not None})
    try:
        return StructuredOutput(**kwargs)
    except ValueError as exc:
        raise BadRequest(str(exc), field) from exc


def _logit_bias(body: Any) -> dict[int, float] | None:
    if not body.logit_bias:
        return None
    # decimal digits only: int() also takes "1_0" and "١٢"
    if bad := next((t for t in body.logit_bias if not _TOKEN_ID.match(t)), None):
        raise BadRequest(f"logit_bias: key {bad[:20]!r} is not a token id", "logit_bias")
    return {int(token): float(bias) for token, bias in body.logit_bias.items()}


def sampling_from(body: Any, max_tokens_cap: int) -> SamplingParams:
    """`max_tokens` unset: the context left after the prompt, up to the tenant's cap (the
    replica knows the prompt's length: `fit_max_tokens`)."""
    requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if requested is not None and requested > max_tokens_cap:
        raise BadRequest(
            f"max_tokens: {requested} is above this tenant's limit of {max_tokens_cap}",
            "max_tokens",
        )
    kv = None
    if body.kv_policy is not None:
        try:
            kv = KVPolicy(**body.kv_policy.model_dump())
        except ValueError as exc:
            message = body_message(str(exc))
            raise BadRequest(message, message.partition(":")[0]) from exc
    try:
        return SamplingParams(
            max_tokens=requested or max_tokens_cap,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            prompt_logprobs=body.prompt_logprobs is not None,
            structured=structured_from(body),
            kv=kv,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=_logit_bias(body),
            min_tokens=body.min_tokens,
            logprobs=body.logprobs_wanted(),
            fit_max_tokens=requested is None,
            cache_salt=body.cache_salt,
            thinking_token_budget=getattr(body, "thinking_token_budget", None),
        )
    except BadRequest:
        raise
    except ValueError as exc:
        raise BadRequest(str(exc), str(exc).split(":")[0]) from exc


def screen(params: SamplingParams, limits: GrammarLimits) -> None:
    """Refuses an inline grammar over the static limits here, at the ingress, so the model
    replica (whose process also runs the engine loop) never parses it. The compile service
    checks again: this is an early answer, not the guard."""
    so = params.structured
    if so is None or so.grammar_id is not None:
        return
    if isinstance(so.json_schema, dict):  # the size first: a big schema costs a walk to copy
        raw = len(json.dumps(so.json_schema, separators=(",", ":"), ensure_ascii=False).encode())
        if raw > limits.max_spec_bytes:  # the spec's canonical form is never smaller
            exc = LimitExceeded("max_spec_bytes", raw, limits.max_spec_bytes)
            raise BadRequest(f"structured.json_schema: {exc}", "structured.json_schema")
    try:
        spec = to_spec(so)
        check_limits(spec, limits)
    except LimitExceeded as exc:
        field = f"structured.{spec.kind}"
        raise BadRequest(f"{field}: {exc}", field) from exc
    except GrammarError as exc:
        raise BadRequest(str(exc), str(exc).split(":")[0]) from exc
