"""Grammar-constrained decoding on the real model: every kind, twins, failures, waiting; each
test runs with `grammar_backend="xgrammar"` and `"llguidance"` (rows whose kind llguidance does
not take, the structural tag, pin xgrammar: a batch mixing backends)."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from services import LLM, SamplingParams, StructuredOutput
from services.grammar.fidelity import loosened_keywords

MASKBENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "maskbench"

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOOL_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<tool>"],
        "tags": [
            {
                "begin": "<tool>",
                "content": {"type": "json_schema", "json_schema": PERSON},
                "end": "</tool>",
            }
        ],
        "at_least_one": True,
        "stop_after_first": True,
    },
}
REGEX = r"\d{3}-\d{3}-\d{4}"

# (question, spec, check of the text)
CASES = [
    ("Describe a person as JSON.", StructuredOutput(json_schema=PERSON), "schema"),
    ('Reply with the JSON object {"answer": "yes"}.', StructuredOutput(json_object=True), "object"),
    ("Give me a phone number.", StructuredOutput(regex=REGEX), "regex"),
    ("Pick a color.", StructuredOutput(choice=["red", "green", "blue"]), "choice"),
    ("Yes or no?", StructuredOutput(grammar='root ::= "yes" | "no"'), "yesno"),
    ("Yes or no?", StructuredOutput(grammar='start: "yes" | "no"'), "yesno"),
    ("Call the tool with a person.", StructuredOutput(structural_tag=TOOL_TAG), "tag"),
]


def check(kind: str, text: str) -> None:
    if kind == "schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text)
    elif kind == "choice":
        assert text in ("red", "green", "blue")
    elif kind == "yesno":
        assert text in ("yes", "no")
    elif kind == "tag":
        m = re.search(r"<tool>(.*)</tool>", text, re.S)
        assert m, text
        jsonschema.validate(json.loads(m.group(1)), PERSON)


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request) -> str:
    return str(request.param)


def engine_args(backend: str) -> dict:
    """With the compile service (the default): llguidance's grammars built in the process."""
    return {"kv_cache_memory": 64 << 20, "grammar_backend": backend}


@pytest.fixture(scope="module")
def llm(loaded_model, backend) -> LLM:
    llm = LLM(loaded=loaded_model, **engine_args(backend))
    yield llm
    llm.engine.grammars.shutdown()


def cases(backend: str) -> list[tuple[str, StructuredOutput, str]]:
    """CASES, the structural tag (xgrammar's format) pinned to xgrammar under llguidance."""
    if backend == "xgrammar":
        return CASES
    return [(q, replace(sp, backend="xgrammar") if k == "tag" else sp, k) for q, sp, k in CASES]


def prompt(llm: LLM, question: str) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": question}])


def params(spec: StructuredOutput | None, max_tokens: int = 96) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=spec)


@pytest.fixture(scope="module")
def mixed_batch(llm, backend):
    prompts = [prompt(llm, q) for q, _, _ in CASES] + [prompt(llm, "Tell me a joke.")]
    sps = [params(spec) for _, spec, _ in cases(backend)] + [params(None, 24)]
    return prompts, sps, llm.generate(prompts, sps)


def test_every_kind_gives_output_that_parses(mixed_batch):
    _, _, outs = mixed_batch
    for (_, _, kind), out in zip(CASES, outs, strict=False):
        assert out.finish_reason == "stop", (kind, out.text, out.warnings)
        check(kind, out.text)
    assert outs[0].validated is True and outs[1].validated is True


def test_each_row_used_the_backend_asked_for(llm, backend):
    engine = llm.engine
    for _, spec, kind in cases(backend):
        req = engine.add_request(prompt(llm, "a"), params(spec, 1))
        while req.structured is not None and req.structured.compiled is None:
            engine.step()
        assert req.structured is not None and req.structured.compiled is not None
        expected = "xgrammar" if kind == "tag" else backend
        assert req.structured.compiled.backend == expected, kind
        engine.abort(req.request_id)
        engine.release(req.request_id)


def test_unconstrained_rows_in_a_mixed_batch_are_untouched(llm, mixed_batch):
    prompts, sps, outs = mixed_batch
    alone = llm.generate([prompts[-1]], [sps[-1]])[0]
    assert outs[-1].token_ids == alone.token_ids and outs[-1].validated is None


def test_overlapped_and_serial_masks_give_identical_tokens(loaded_model, backend, mixed_batch):
    prompts, sps, outs = mixed_batch
    serial = LLM(loaded=loaded_model, overlap_masks=False, **engine_args(backend))
    assert [o.token_ids for o in serial.generate(prompts, sps)] == [o.token_ids for o in outs]
    serial.engine.grammars.shutdown()


def test_a_bad_grammar_fails_alone_with_the_reason(llm):
    outs = llm.generate(
        [prompt(llm, "a"), prompt(llm, "Pick a color.")],
        [params(StructuredOutput(regex="(unclosed")), params(StructuredOutput(choice=["red"]))],
    )
    assert outs[0].finish_reason == "error" and "structured.regex" in outs[0].warnings[0]
    assert outs[1].finish_reason == "stop" and outs[1].text == "red"


def test_fidelity_warn_reports_and_strict_refuses(llm):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
    warn, strict = llm.generate(
        [prompt(llm, "Three numbers as a JSON array.")] * 2,
        [
            params(StructuredOutput(json_schema=schema)),
            params(StructuredOutput(json_schema=schema, fidelity="strict")),
        ],
    )
    assert "#/uniqueItems: enforced by the check, not the grammar" in warn.warnings
    assert warn.finish_reason == "stop" and warn.validated
    assert strict.finish_reason == "error" and "cannot enforce" in strict.warnings[0]


def test_a_whitespace_streak_cannot_run_to_max_tokens(llm):
    spec = StructuredOutput(grammar='root ::= [ \\t\\n]* "x"', max_whitespace_run=3)
    # (llguidance's masks let the model write 64 spaces a token; xgrammar's, one: 3 in a row
    # is a streak under both)
    forced = StructuredOutput(grammar='root ::= "' + " " * 200 + 'x"', max_whitespace_run=3)
    outs = llm.generate([prompt(llm, "Say x.")] * 2, [params(spec, 64), params(forced, 200)])
    assert outs[0].finish_reason == "stop" and outs[0].text.strip() == "x"
    assert outs[1].finish_reason == "error"
    assert "max_whitespace_run" in outs[1].warnings[-1] and len(outs[1].token_ids) < 200


class GatedProvider:
    """Compiles for real, but hands the result out only when the test opens the gate."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.gate = threading.Event()

    def shutdown(self) -> None:
        pass

    def submit(self, spec, tenant="default"):
        out: Future = Future()

        def later() -> None:
            self.gate.wait(60)
            out.set_result(self.backend.compile(spec))

        threading.Thread(target=later, daemon=True).start()
        return out


def test_a_request_waiting_for_its_grammar_does_not_block_the_loop(loaded_model, llm, backend):
    gated = GatedProvider(llm.engine.grammars.backend)
    other = LLM(
        loaded=loaded_model,
        kv_cache_memory=32 << 20,
        grammar_backend=backend,
        grammar_provider=gated,
    )
    engine = other.engine
    waiting = engine.add_request(prompt(other, "Pick."), params(StructuredOutput(choice=["ok"])))
    free = engine.add_request("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    while not free.finished:
        engine.step()
    assert not waiting.finished and waiting.num_computed_tokens == 0
    gated.gate.set()
    while not waiting.finished:
        engine.step()
    assert waiting.finish_reason == "stop" and waiting.detokenizer.text == "ok"


def maskbench_sample(n: int) -> list[dict]:
    files = sorted(MASKBENCH.glob("*.json"))
    picked = []
    for f in files[:: max(1, len(files) // (4 * n))]:
        schema = json.loads(f.read_text())["schema"]
        text = json.dumps(schema)
        # small, fully enforced, and no `{}` (any value) a small model can ramble inside forever
        if not loosened_keywords(schema) and len(text) < 800 and "{}" not in text:
            picked.append(schema)
        if len(picked) == n:
            break
    return picked


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason="../shared/data/maskbench is not present")
def test_real_world_schemas_decode_to_valid_json(llm):
    schemas = maskbench_sample(4)
    assert len(schemas) == 4
    question = "Produce a JSON value for this schema: "
    outs = llm.generate(
        [prompt(llm, question + json.dumps(s)[:400]) for s in schemas],
        [params(StructuredOutput(json_schema=s), 256) for s in schemas],
    )
    # A grammar that terminated guarantees a valid document; a 135M model may still loop inside
    # an unbounded string until max_tokens (the full 610-schema count is in benchmarks/).
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 2, [o.text[-80:] for o in outs]
    for out in finished:
        assert out.validated is True, (out.text, out.warnings)
    for out in outs:
        if out.finish_reason == "length":
            assert out.validated is False  # reported, not hidden


SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}  # adaptive


@pytest.mark.parametrize("jump_forward", [False, True], ids=["speculative", "with-jump-forward"])
def test_speculation_gives_the_plain_tokens_for_every_kind(
    loaded_model, backend, mixed_batch, jump_forward
):
    """Drafts verified against each grammar kind's mask give greedy decoding's tokens (with
    jump-forward: the tokens jump-forward gives alone)."""
    prompts, sps, outs = mixed_batch
    args = engine_args(backend) | {"jump_forward": jump_forward}
    if jump_forward:
        plain = LLM(loaded=loaded_model, **args)
        outs = plain.generate(prompts, sps)
        plain.engine.grammars.shutdown()
    spec = LLM(loaded=loaded_model, speculative=SPECULATIVE, **args)
    drafted = spec.generate(prompts, sps)
    spec.engine.grammars.shutdown()
    assert [o.token_ids for o in drafted] == [o.token_ids for o in outs]
    assert sum(o.metrics.num_draft_tokens for o in drafted) > 0
    assert all(o.validated is not False for o in drafted)


def test_jump_forward_outputs_validate_and_save_forward_passes(loaded_model, backend, mixed_batch):
    prompts, sps, outs = mixed_batch
    jf = LLM(loaded=loaded_model, jump_forward=True, **engine_args(backend))
    jumped = jf.generate(prompts, sps)
    jf.engine.grammars.shutdown()
    for (_, _, kind), out in zip(CASES, jumped, strict=False):
        assert out.finish_reason == "stop", (kind, out.text, out.warnings)
        check(kind, out.text)
    forced = sum(o.metrics.num_forced_tokens for o in jumped)
    assert forced > 0  # the schema, object and tag cases all have forced spans
    assert jumped[-1].token_ids == outs[-1].token_ids  # unconstrained rows never jump
    # greedy, and retokenization canonical for these short forced spans: the same text
    same = sum(a.text == b.text for a, b in zip(jumped, outs, strict=True))
    assert same >= len(outs) - 2, [(a.text, b.text) for a, b in zip(jumped, outs, strict=True)]


def test_auto_enforces_what_xgrammar_loosens(loaded_model):
    """A length beside a pattern is loosened by xgrammar and enforced by llguidance: auto
    takes llguidance, with the compile workers on (the default)."""
    auto = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_backend="auto")
    code = {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5}
    schema = {"type": "object", "properties": {"code": code}, "required": ["code"]}
    out = auto.generate(
        prompt(auto, "A JSON object with a short code."),
        params(StructuredOutput(json_schema=schema, fidelity="strict")),
    )[0]
    assert out.finish_reason == "stop" and out.validated is True and not out.warnings
    auto.engine.grammars.provider.shutdown()
