"""Checked decoding on the real model: a finished JSON output whose check fails goes back to the
value that failed and samples it again (structured/checked.py), its output held until it passed;
a value that can never pass ends in a 422-class error within the retry budget, naming the keyword
and the path, beside a victim whose tokens do not change. `check_retries=0` is the plain twin."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from services import LLM, SamplingParams, StructuredOutput
from services.engine.params import RequestOutput

PROMPT = "Give a JSON object with a person's name and age. JSON: "
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
VICTIM = ("The history of the printing press begins", SamplingParams(max_tokens=12, temperature=0))


def params(schema: dict) -> SamplingParams:
    return SamplingParams(
        max_tokens=40, temperature=0, structured=StructuredOutput(json_schema=schema)
    )


def with_property(schema: dict, name: str, **extra: object) -> dict:
    out = copy.deepcopy(schema)
    out["properties"][name].update(extra)
    return out


def not_named(name: str) -> dict:
    """PERSON with every name but `name`, in a shape no fold says in other keywords (a `not`
    of two keywords; `not: {const: name}` alone the grammar enforces: grammar/fold.py)."""
    return with_property(PERSON, "name", **{"not": {"const": name, "type": "string"}})


@pytest.fixture(scope="module")
def llm(loaded_model):
    llm = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0)
    yield llm
    llm.engine.grammars.shutdown()


@pytest.fixture(scope="module")
def greedy_name(llm) -> str:
    out = llm.generate([PROMPT], params(PERSON))[0]
    assert out.finish_reason == "stop" and out.validated, out.warnings
    return json.loads(out.text)["name"]


def test_a_value_that_fails_its_check_is_sampled_again_until_it_passes(llm, greedy_name):
    """`not` is enforced by no grammar: the greedy name is excluded by the schema, so the first
    output fails its check; the request goes back to the name and the output that comes out
    validates."""
    schema = not_named(greedy_name)
    out = llm.generate([PROMPT], params(schema))[0]
    assert "#/properties/name/not: enforced by the check, not the grammar" in out.warnings
    assert out.finish_reason == "stop" and out.validated is True, out.warnings
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert value["name"] != greedy_name
    assert any("passed its check after" in w for w in out.warnings), out.warnings


def test_the_plain_twin_ends_in_an_error_at_once(loaded_model, greedy_name):
    twin = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0, check_retries=0)
    try:
        schema = not_named(greedy_name)
        out = twin.generate([PROMPT], params(schema))[0]
        assert out.finish_reason == "error" and out.validated is False
        assert "#/properties/name/not: not enforced" in out.warnings
        assert json.loads(out.text)["name"] == greedy_name  # the unchecked output, as it was
    finally:
        twin.engine.grammars.shutdown()


def test_a_folded_not_is_the_grammars_to_enforce(llm, greedy_name):
    """`not: {const: x}` over a string is said as a pattern (grammar/fold.py): the greedy name
    is never written, no check is left to go back for, and nothing is reported loosened."""
    schema = with_property(PERSON, "name", **{"not": {"const": greedy_name}})
    out = llm.generate([PROMPT], params(schema))[0]
    assert out.finish_reason == "stop" and out.validated is True, out.warnings
    assert not [w for w in out.warnings if "not" in w.split(": ", 1)[0]], out.warnings
    assert not any("passed its check after" in w for w in out.warnings), out.warnings
    assert json.loads(out.text)["name"] != greedy_name


NEVER = {
    # no value passes `not: {}`
    "not-anything": (with_property(PERSON, "age", **{"not": {}}), "not at /age"),
    # two equal items of a one-value enum are never unique
    "unique-of-one": (
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["a"]},
                    "minItems": 2,
                    "maxItems": 2,
                    "uniqueItems": True,
                }
            },
            "required": ["tags"],
        },
        "/tags",
    ),
    # a value matching both of two equal branches fails `oneOf`
    "one-of-twins": (
        {
            "type": "object",
            "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "integer"}]}},
            "required": ["n"],
        },
        "/n",
    ),
}


def test_values_that_can_never_pass_end_in_an_error_beside_an_untouched_victim(llm):
    alone = llm.generate([VICTIM[0]], VICTIM[1])[0]
    names = list(NEVER)
    outs = llm.generate(
        [VICTIM[0]] + [PROMPT] * len(names),
        [VICTIM[1]] + [params(NEVER[n][0]) for n in names],
    )
    assert outs[0].token_ids == alone.token_ids and outs[0].finish_reason == alone.finish_reason
    for name, out in zip(names, outs[1:], strict=True):
        where = NEVER[name][1]
        assert out.finish_reason == "error" and out.validated is not True, (name, out.warnings)
        assert out.error_status == 422, (name, out.error_status)
        assert any(where in w for w in out.warnings), (name, out.warnings)


def test_a_checked_output_is_held_until_it_passed(llm, greedy_name):
    """A sent token cannot be taken back: nothing of a checked request's output goes out before
    it is done, then all of it at once; an unchecked one streams as before."""
    engine = llm.engine
    checked = not_named(greedy_name)
    reqs = {
        "checked": engine.add_request(PROMPT, params(checked), request_id="held"),
        "plain": engine.add_request(PROMPT, params(PERSON), request_id="streams"),
    }
    seen: dict[str, list[RequestOutput]] = {k: [] for k in reqs}
    while engine.has_unfinished():
        engine.step()
        for k, r in reqs.items():
            if r.num_output_tokens and not (seen[k] and seen[k][-1].finished):
                seen[k].append(engine.make_output(r))
    for r in reqs.values():
        engine.release(r.request_id)
    early = [o for o in seen["checked"] if not o.finished]
    assert early and all(o.delta_text == "" and o.text == "" for o in early)
    last = seen["checked"][-1]
    assert last.finished and last.validated and last.delta_text == last.text
    jsonschema.validate(json.loads(last.text), checked)
    assert sum(bool(o.delta_text) for o in seen["plain"]) > 1  # streamed in pieces
