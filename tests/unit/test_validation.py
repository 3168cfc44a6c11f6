"""Output validation: jsonschema-rs against MaskBench's labels, the traps it must survive, the
time bound, one validator per compiled grammar."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.engine.grammar import validation
from services.engine.grammar.backend import CompiledGrammar
from services.engine.grammar.validation import OutputValidator, validate

MASKBENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "maskbench"


def grammar(schema: dict) -> CompiledGrammar:
    return CompiledGrammar(handle=None, schema=schema)


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason="../shared/data/maskbench is not present")
def test_verdicts_agree_with_every_maskbench_label():
    """Formats included: the labels assert them (the `jsonschema` package, which treats formats
    as annotations, disagreed with 38 of these)."""
    disagree, total = [], 0
    for path in sorted(MASKBENCH.glob("*.json")):
        case = json.loads(path.read_text())
        compiled = grammar(case["schema"])
        for instance in case["tests"]:
            total += 1
            ok, _ = validate(compiled, json.dumps(instance["data"]))
            if ok is not instance["valid"]:
                disagree.append(path.name)
    assert total > 1000 and not disagree, disagree[:10]


def test_an_unresolvable_reference_is_a_reason_not_an_exception():
    compiled = grammar({"type": "object", "not": {"$ref": "#/$defs/missing"}})
    ok, why = validate(compiled, "{}")
    assert ok is False and "schema could not be used to validate" in why and "missing" in why
    assert isinstance(compiled.validator, Exception)  # remembered: the next output is as quick


def test_catastrophic_patterns_are_matched_in_linear_time():
    compiled = grammar({"type": "string", "not": {"pattern": "^(a+)+$"}})
    start = time.perf_counter()
    ok, why = validate(compiled, json.dumps("a" * 5000 + "!"))
    assert ok is True and why is None
    assert time.perf_counter() - start < 5  # Python's `re` takes longer than the universe here


@pytest.mark.parametrize(
    ("text", "reason"),
    [('{"a": 1', "not JSON"), ("[" * 100_000, "not JSON"), ('{"a": "x"}', "output failed")],
)
def test_bad_outputs_are_refused_with_a_reason(text, reason):
    compiled = grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    ok, why = validate(compiled, text)
    assert ok is False and reason in why


def test_one_validator_per_compiled_grammar():
    compiled = grammar({"type": "integer"})
    assert validate(compiled, "3") == (True, None)
    first = compiled.validator
    assert validate(compiled, '"x"')[0] is False
    assert compiled.validator is first


def test_a_validation_past_its_deadline_is_a_refusal_and_later_ones_do_not_wait(monkeypatch):
    real = validation.validate

    def slow_once(compiled, text):
        if text == "slow":
            time.sleep(1.0)
        return real(compiled, text)

    monkeypatch.setattr(validation, "validate", slow_once)
    validator = OutputValidator(timeout_s=0.1)
    compiled = grammar({"type": "integer"})
    stuck = validator.submit(compiled, "slow", lambda: None)
    time.sleep(0.2)
    assert validator.answer(stuck) == (False, "output validation did not finish within 0.1 s")
    later = validator.submit(compiled, "7", lambda: None)  # not queued behind the stuck one
    deadline = time.monotonic() + 0.5
    while (verdict := validator.answer(later)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert verdict == (True, None)
    validator.shutdown()
