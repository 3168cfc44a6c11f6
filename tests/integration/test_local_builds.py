"""`LocalBuilds` on the real tokenizer: llguidance's grammars judged in the replica (the static
limits, llguidance's parser limits from `GrammarLimits`, the mask-time probe), one verdict per
grammar that records its backend (a refusal the load can cause: per tenant), and `auto`'s choice
made from it (services/compiler/local_builds.py)."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
from hostile import DEEP, SLOW_MASK_REGEX

from grammar_registry.limits import GrammarLimits
from services.compiler.local_builds import LocalBuilds
from services.grammar.backend import CompiledGrammar, GrammarError
from services.grammar.backends import Backends
from services.grammar.structured import StructuredOutput
from services.grammar.xgrammar_backend import XGrammarBackend

PLAIN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# llguidance knows no `uri-reference` format (a warning); xgrammar reports nothing for it
UNKNOWN_FORMAT = {"type": "string", "format": "uri-reference"}
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}  # neither enforces


@pytest.fixture(scope="module")
def xgrammar(loaded_model) -> XGrammarBackend:
    tok = loaded_model.tokenizer
    return XGrammarBackend(tok, int(loaded_model.model.config.vocab_size), [tok.eos_token_id])


@pytest.fixture
def make(loaded_model, xgrammar):
    """`make(default, **LocalBuilds options)`: fresh backends (limits are per instance)."""
    tok = loaded_model.tokenizer
    made: list[LocalBuilds] = []

    def build(default: str = "auto", **options) -> LocalBuilds:
        vocab = int(loaded_model.model.config.vocab_size)
        backends = Backends(tok, vocab, [tok.eos_token_id], default, xgrammar=xgrammar)
        made.append(LocalBuilds(backends, **options))
        return made[-1]

    yield build
    for local in made:
        local.close()


class Service:
    """The compile service's path, in this process: xgrammar's grammar, each call counted. Like
    the real provider, it raises at once what it refuses before any compile (`fidelity`)."""

    def __init__(self, local: LocalBuilds) -> None:
        self.backends = local.backends
        self.calls: list[str] = []

    def __call__(self, spec: StructuredOutput, tenant: str) -> Future[CompiledGrammar]:
        self.calls.append(tenant)
        out: Future[CompiledGrammar] = Future()
        try:
            out.set_result(self.backends.xgrammar.compile(spec))
        except GrammarError as exc:
            if exc.reason == "fidelity":
                raise
            out.set_exception(exc)
        return out


def get(local: LocalBuilds, service: Service, spec: StructuredOutput, tenant: str = "a"):
    return local.submit(spec, tenant, service).result(timeout=60)


def test_a_verdict_is_kept_per_grammar_and_records_its_backend(make):
    local = make("auto", share_inline=True)
    service = Service(local)
    spec = StructuredOutput(json_schema=PLAIN)
    first = get(local, service, spec)
    assert first.backend == "llguidance" and local.builds == 1
    assert get(local, service, spec, "b") is first and local.builds == 1  # shared, not rebuilt
    own = make("auto")  # the default: each tenant's inline grammars are its own
    mine = get(own, Service(own), spec)
    assert get(own, Service(own), spec, "b") is not mine and own.builds == 2
    judged = local.verdict(spec, "a")
    assert judged.verdict.ok and judged.verdict.backend == "llguidance"
    assert judged.verdict.mask_ms > 0 and not service.calls


def test_auto_asks_xgrammar_once_llguidance_loosens_a_keyword(make):
    local = make("auto")
    service = Service(local)
    spec = StructuredOutput(json_schema=UNKNOWN_FORMAT)
    assert get(local, service, spec).backend == "xgrammar"
    assert get(local, service, spec).backend == "xgrammar"
    assert local.builds == 1 and service.calls == ["a", "a"]  # the choice is not rebuilt
    # both loosen: the one loosening no more keywords (llguidance on a tie); strict refuses
    tie = get(local, service, StructuredOutput(json_schema=UNIQUE))
    assert tie.backend == "llguidance" and tie.warnings
    with pytest.raises(GrammarError) as err:
        get(local, service, StructuredOutput(json_schema=UNIQUE, fidelity="strict"))
    assert err.value.reason == "fidelity"


def test_a_pinned_backend_gets_its_own_verdict_judged_per_request(make):
    local = make("xgrammar")
    service = Service(local)
    spec = StructuredOutput(json_schema=UNIQUE, backend="llguidance")
    assert local.builds_here(spec) and not local.builds_here(StructuredOutput(json_schema=PLAIN))
    compiled = get(local, service, spec)
    assert compiled.backend == "llguidance" and compiled.warnings == ["#/uniqueItems: not enforced"]
    strict = StructuredOutput(json_schema=UNIQUE, backend="llguidance", fidelity="strict")
    with pytest.raises(GrammarError, match="uniqueItems") as err:
        get(local, service, strict)
    assert err.value.reason == "fidelity" and local.builds == 1 and not service.calls


def test_static_limits_come_before_any_build(make):
    local = make("llguidance")
    with pytest.raises(GrammarError, match="max_depth") as err:
        get(local, Service(local), StructuredOutput(json_schema=DEEP))
    assert err.value.status == 400 and local.builds == 0


def test_parser_limits_come_from_grammar_limits_and_the_probe_meets_them(make):
    local = make("auto", limits=GrammarLimits(max_lexer_states=50, mask_lexer_fuel=123_456))
    llg = local.backends.llguidance
    assert llg.limits.max_lexer_states == 50 and llg.limits.step_lexer_fuel == 123_456
    service = Service(local)
    pinned = StructuredOutput(regex=SLOW_MASK_REGEX, backend="llguidance")
    with pytest.raises(GrammarError, match="parser's limits") as err:
        get(local, service, pinned)
    assert err.value.reason == "limit" and err.value.status == 400


def test_a_slow_probe_refuses_for_that_tenant_only_and_auto_turns_to_xgrammar(make):
    local = make("auto", mask_budget_ms=1e-6)  # every mask is over this budget
    service = Service(local)
    pinned = StructuredOutput(json_schema=PLAIN, backend="llguidance")
    with pytest.raises(GrammarError, match="masks take") as err:
        get(local, service, pinned, "a")
    assert err.value.reason == "slow_mask" and err.value.status == 422
    assert get(local, service, StructuredOutput(json_schema=PLAIN), "a").backend == "xgrammar"
    local.mask_budget_ms = 1e6  # another tenant, an idle machine: its own verdict
    assert get(local, service, pinned, "b").backend == "llguidance"
    with pytest.raises(GrammarError, match="masks take"):
        get(local, service, pinned, "a")  # kept for "a"


def test_a_downgrade_refuses_llguidance_for_the_tenant_and_auto_turns_to_xgrammar(make):
    local = make("auto")
    service = Service(local)
    spec = StructuredOutput(json_schema=PLAIN)
    assert get(local, service, spec, "a").backend == "llguidance"
    slow = GrammarError("structured.json_schema: masks slower than the budget", "slow_mask", 422)
    local.downgrade(spec, "a", slow)
    assert get(local, service, spec, "a").backend == "xgrammar"
    assert get(local, service, spec, "b").backend == "llguidance"
    with pytest.raises(GrammarError, match="masks slower") as err:
        get(local, service, StructuredOutput(json_schema=PLAIN, backend="llguidance"), "a")
    assert err.value.status == 422


def test_a_refusal_the_load_may_have_caused_expires(make):
    local = make("auto", refusal_ttl_s=0.2)
    service = Service(local)
    spec = StructuredOutput(json_schema=PLAIN)
    slow = GrammarError("structured.json_schema: masks slower than the budget", "slow_mask", 422)
    local.downgrade(spec, "a", slow)
    assert get(local, service, spec, "a").backend == "xgrammar"
    time.sleep(0.3)  # past its lifetime: judged again (the shared verdict was never refused)
    assert get(local, service, spec, "a").backend == "llguidance"


def test_a_build_that_raises_anything_still_answers_the_request(make, monkeypatch):
    local = make("llguidance")

    def broken(spec):
        raise RuntimeError("boom")

    monkeypatch.setattr(local.backends.llguidance, "compile", broken)
    with pytest.raises(GrammarError, match="boom"):
        get(local, Service(local), StructuredOutput(json_schema=PLAIN))
