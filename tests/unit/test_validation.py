"""Output validation: jsonschema-rs against MaskBench's labels, the traps it must survive, the
time bound in a killable worker, one validator per schema."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import pytest
from hostile import chained_if_then

from services.engine.structured.validation import OutputValidator
from services.grammar.backend import CompiledGrammar
from services.sandbox.validate import SchemaValidator, Validators, schema_text

MASKBENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "maskbench"


def verdict(schema: dict, text: str, validators: Validators | None = None):
    return (validators or Validators()).verdict(schema_text(schema), text)


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason="../shared/data/maskbench is not present")
def test_verdicts_agree_with_every_maskbench_label():
    """Formats included: the labels assert them (the `jsonschema` package, which treats formats
    as annotations, disagreed with 38 of these)."""
    disagree, total = [], 0
    validators = Validators()
    for path in sorted(MASKBENCH.glob("*.json")):
        case = json.loads(path.read_text())
        for instance in case["tests"]:
            total += 1
            ok, _ = verdict(case["schema"], json.dumps(instance["data"]), validators)
            if ok is not instance["valid"]:
                disagree.append(path.name)
    assert total > 1000 and not disagree, disagree[:10]


def test_an_unresolvable_reference_is_a_reason_not_an_exception():
    validators = Validators()
    schema = {"type": "object", "not": {"$ref": "#/$defs/missing"}}
    ok, why = verdict(schema, "{}", validators)
    assert ok is False and "schema could not be used to validate" in why and "missing" in why
    assert verdict(schema, "[]", validators) == (ok, why)  # remembered, refused as quickly


def test_a_remote_reference_is_never_fetched_and_a_local_one_still_resolves():
    """jsonschema-rs fetches a remote `$ref` over HTTP unless told not to: a tenant's schema
    would make the validator call any address it names. A server on loopback sees no request."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "string"}')

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/s.json"
        ok, why = verdict({"type": "object", "properties": {"a": {"$ref": url}}}, '{"a": "x"}')
        assert ok is False and "a remote $ref is not fetched" in why and url in why
        assert hits == []
    finally:
        server.shutdown()
    local = {"$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/s"}}}
    assert verdict(local, '{"a": "x"}') == (True, None)
    assert verdict(local, '{"a": 1}')[0] is False


def test_catastrophic_patterns_are_matched_in_linear_time():
    start = time.perf_counter()
    ok, why = verdict(
        {"type": "string", "not": {"pattern": "^(a+)+$"}}, json.dumps("a" * 5000 + "!")
    )
    assert ok is True and why is None
    assert time.perf_counter() - start < 5  # Python's `re` takes longer than the universe here


@pytest.mark.parametrize(
    ("text", "reason"),
    [('{"a": 1', "not JSON"), ("[" * 100_000, "not JSON"), ('{"a": "x"}', "output failed")],
)
def test_bad_outputs_are_refused_with_a_reason(text, reason):
    ok, why = verdict({"type": "object", "properties": {"a": {"type": "integer"}}}, text)
    assert ok is False and reason in why


def test_one_validator_per_schema():
    validators = Validators(keep=2)
    assert verdict({"type": "integer"}, "3", validators) == (True, None)
    first = validators._validator(schema_text({"type": "integer"}))
    assert verdict({"type": "integer"}, '"x"', validators)[0] is False
    assert validators._validator(schema_text({"type": "integer"})) is first


def test_a_validation_that_would_freeze_the_process_is_killed_and_no_one_else_waits():
    """The hostile schema's check runs past the deadline in its worker (killed, restarted);
    another tenant's check meanwhile, and the hostile tenant's next one, answer at once."""
    validator = SchemaValidator(workers=2, timeout_s=0.5)
    hostile = schema_text(chained_if_then(31))
    plain = schema_text({"type": "integer"})
    try:
        assert validator.check([(plain, "1")]) == [(True, None)]  # the workers are up
        out: list = []
        thread = threading.Thread(
            target=lambda: out.append(validator.check([(hostile, '"x"')], "B"))
        )
        thread.start()
        time.sleep(0.1)
        start = time.perf_counter()
        assert validator.check([(plain, "2")], "A") == [(True, None)]
        assert time.perf_counter() - start < 0.4  # never queued behind the hostile check
        thread.join(10)
        assert out == [[(False, "output validation did not finish within 0.5 s")]]
        assert validator.check([(plain, '"no"')], "B")[0][0] is False  # B's next one is judged
    finally:
        validator.close()


def test_in_process_and_worker_validation_agree():
    """`workers=0` is the plain twin: the same verdicts, in the calling process."""
    cases = [
        ({"type": "integer"}, "3"),
        ({"type": "integer"}, '"x"'),
        ({"type": "string", "format": "email"}, '"not an email"'),
        ({"not": {"$ref": "#/$defs/none"}}, "1"),
        ({"type": "object"}, '{"a": '),
    ]
    checks = [(schema_text(s), t) for s, t in cases]
    plain, isolated = SchemaValidator(workers=0), SchemaValidator(workers=1)
    try:
        assert plain.check(checks) == isolated.check(checks)
    finally:
        isolated.close()


def test_the_engine_never_blocks_on_a_validation():
    validator = OutputValidator(timeout_s=0.3, workers=1)
    try:
        stuck = validator.submit(
            CompiledGrammar(handle=None, schema=chained_if_then(31)), '"x"', lambda: None, "B"
        )
        assert validator.answer(stuck) is None  # not yet: the engine goes on stepping
        deadline = time.monotonic() + 10
        while (got := validator.answer(stuck)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == (False, "output validation did not finish within 0.3 s", None)
    finally:
        validator.shutdown()
