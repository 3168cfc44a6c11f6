"""The compile service for real: worker processes, a real Redis, the real tokenizer and model.

Redis comes from `REDIS_URL` (`make test` starts one when none answers); these tests use their own
database number and flush it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import xgrammar as xgr
from hostile import slow_compile_schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_registry import GrammarSpec, RedisVerdicts, Verdict
from services import LLM, SamplingParams, StructuredOutput
from services.compiler import CompilerConfig, CompileService, ServiceGrammarProvider
from services.grammar import GrammarError
from services.grammar.xgrammar_backend import XGrammarBackend

ROOT = Path(__file__).resolve().parents[2]
DB = 13
MASKBENCH = ROOT.parent / "shared" / "data" / "maskbench"
DEADLINE_S = 1.5
SECRET = "compile-service-test-verdict-secret"  # what the chart generates in the service


def redis_url(db: int = DB) -> str:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + f"/{db}" if base.count("/") > 2 else f"{base}/{db}"


@pytest.fixture(scope="module")
def rclient():
    client = redis.Redis.from_url(redis_url())
    client.ping()  # `make test` guarantees a Redis; failing here means the setup step broke
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture(scope="module")
def llm(loaded_model):
    """xgrammar's grammars: the ones the compile service compiles."""
    return LLM(
        loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0, grammar_backend="xgrammar"
    )


@pytest.fixture(scope="module")
def backend(llm) -> XGrammarBackend:
    be = llm.engine.grammars.backend.xgrammar
    assert isinstance(be, XGrammarBackend)
    return be


@pytest.fixture(scope="module")
def service(backend, rclient):
    svc = CompileService(
        backend.tokenizer_info,
        # every compile ships its blob here: these tests are about storing and loading them
        CompilerConfig(
            workers=2, deadline_s=DEADLINE_S, verdict_secret=SECRET, blob_min_compile_s=0
        ),
        redis=rclient,
    )
    assert svc.pool.wait_ready()
    yield svc
    svc.close()


@pytest.fixture
def provider(backend, service):
    prov = ServiceGrammarProvider(backend, service)
    yield prov
    prov.shutdown()


def person(tag: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, tag: {"type": "integer"}},
        "required": ["name", tag],
    }


def test_verdicts_are_stored_in_redis_and_reused(service, rclient):
    spec = GrammarSpec(kind="json_schema", source=person("age"))
    before = service.compiles
    first = service.verdict(spec)
    assert first.ok and first.compile_s > 0 and first.blob_bytes > 0
    assert rclient.exists(service.key(spec))
    again = service.verdict(spec)
    assert again.ok and service.compiles == before + 1
    # a blob is stored only where loading beat compiling; otherwise the entry says compile locally
    assert (again.blob is not None) == (first.load_s < service.config.blob_gain * first.compile_s)


def test_a_quick_compile_ships_no_blob(backend):
    from services.compiler.compile_job import compile_job

    job = {"spec": GrammarSpec(kind="json_schema", source=person("size")).model_dump_json()}
    job |= {"mask_budget_ms": 20.0, "probe_steps": 8, "seed": 0}
    quick = compile_job(backend, {**job, "blob_min_compile_s": 60.0})
    shipped = compile_job(backend, {**job, "blob_min_compile_s": 0.0})
    assert quick["ok"] and "blob" not in quick and quick["mask_ms"] > 0
    assert shipped["ok"] and len(shipped["blob"]) > 0 and shipped["load_s"] > 0
    assert quick["warnings"] == shipped["warnings"]


def test_cached_and_fresh_grammars_decode_the_same_tokens(llm, provider, service):
    so = StructuredOutput(json_schema=person("year"))
    prompt = "Give a person as JSON."
    params = SamplingParams(max_tokens=40, temperature=0, structured=so)
    plain = llm.generate(prompt, params)[0]  # compiled in-process, no service
    served = LLM(
        loaded=llm.engine.runner.loaded, kv_cache_memory=64 << 20, grammar_provider=provider
    )
    first = served.generate(prompt, params)[0]
    cached = served.generate(prompt, params)[0]  # the L1 hit
    assert plain.token_ids == first.token_ids == cached.token_ids
    assert plain.validated and provider.stats["l1"] >= 1


SECOND_PROCESS = """
import json, sys
from services import LLM, SamplingParams, StructuredOutput
from services.compiler import CompilerConfig, provider_for
from services.models import load_model

def main():
    # a Redis verdict cache needs the secret every process sharing it holds
    config = CompilerConfig(verdict_secret=sys.argv[3])
    provider = provider_for(1, sys.argv[1], config=config)
    llm = LLM(loaded=load_model(), kv_cache_memory=64 << 20, grammar_provider=provider,
              grammar_backend="xgrammar")
    params = SamplingParams(max_tokens=40, temperature=0,
                            structured=StructuredOutput(json_schema=json.loads(sys.argv[2])))
    out = llm.generate("Give a person as JSON.", params)[0]
    provider = llm.engine.grammars.provider
    print(json.dumps({"tokens": out.token_ids, "compiles": provider.service.compiles,
                      "stats": provider.stats}))
    llm.engine.grammars.shutdown()

if __name__ == "__main__":
    main()
"""


def _second_process(tmp_path: Path, schema: dict) -> dict:
    script = tmp_path / "second.py"
    script.write_text(SECOND_PROCESS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script), redis_url(), json.dumps(schema), SECRET],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_gets_a_redis_hit_and_decodes_identically(llm, tmp_path, rclient):
    schema = person("height")
    params = SamplingParams(
        max_tokens=40, temperature=0, structured=StructuredOutput(json_schema=schema)
    )
    reference = llm.generate("Give a person as JSON.", params)[0].token_ids
    rclient.flushdb()
    cold = _second_process(tmp_path, schema)
    warm = _second_process(tmp_path, schema)
    assert cold["compiles"] == 1
    assert warm["compiles"] == 0  # the verdict came from Redis: no worker compile
    assert cold["tokens"] == warm["tokens"] == reference


def test_an_unloadable_blob_is_ignored_and_replaced(backend, service, provider, rclient):
    other = xgr.TokenizerInfo([chr(i) for i in range(32, 127)])
    spec = GrammarSpec(kind="regex", source="[a-z]{2,6}-[0-9]{3}")
    foreign = xgr.GrammarCompiler(other).compile_regex(spec.source).serialize_json()
    store = RedisVerdicts(rclient, secret=SECRET.encode())
    for blob in (zlib.compress(foreign.encode()), b"not zlib at all"):
        key = service.key(spec, "default")  # an inline grammar: the tenant's own scope
        store.put(key, Verdict(ok=True, blob=blob, blob_bytes=len(blob)))
        provider.l1 = type(provider.l1)(provider.l1.max_bytes)  # a fresh replica's L1...
        service.recent = type(service.recent)(service.recent.max_bytes)  # ... and service
        compiled = provider.submit(StructuredOutput(regex=spec.source)).result(timeout=30)
        state = backend.new_state(compiled)
        assert all(state.accept_token(t) for t in backend_tokens(backend, "ab-123"))
        replaced = store.get(key)
        assert replaced is not None and replaced.ok and replaced.blob != blob
        if replaced.blob is not None:
            backend.load(replaced.blob_json())  # the replacement loads with this tokenizer


def backend_tokens(backend: XGrammarBackend, text: str) -> list[int]:
    vocab = backend.tokenizer_info.decoded_vocab
    ids = {v: i for i, v in enumerate(vocab) if isinstance(v, bytes)}
    return [ids[ch.encode()] for ch in text]


def test_killing_redis_changes_nothing_but_speed(backend, service, redis_server):
    url, proc = redis_server()
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    own = CompileService(backend.tokenizer_info, service.config, redis=client, pool=service.pool)
    prov = ServiceGrammarProvider(backend, own)
    try:
        a = StructuredOutput(regex="[0-9]{4}-[0-9]{2}")
        prov.submit(a).result(timeout=30)
        assert own.compiles == 1 and client.dbsize() == 1
        proc.kill()
        proc.wait()
        prov.l1 = type(prov.l1)(prov.l1.max_bytes)
        for so in (a, StructuredOutput(choice=["yes", "no"])):
            compiled = prov.submit(so).result(timeout=30)
            assert backend.new_state(compiled) is not None
        # `a` comes from the service's recent verdicts, the choice compiles without Redis
        assert own.compiles == 2 and own.verdicts.errors >= 1
    finally:
        prov.shutdown()
        proc.kill()


def _deep(n: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(n):
        node = {"type": "object", "properties": {"x": node}}
    return node


PATHOLOGICAL = [
    ("deep nesting", StructuredOutput(json_schema=_deep(200)), "limit"),
    (
        "huge maxLength",
        StructuredOutput(json_schema={"type": "string", "maxLength": 10**9}),
        "limit",
    ),
    ("nested repetition", StructuredOutput(regex="(.{0,50}){0,50}"), "limit"),
    (
        "giant enum",
        StructuredOutput(json_schema={"enum": [f"v{i}" for i in range(20000)]}),
        "limit",
    ),
    (
        "100-tool structural tag",
        StructuredOutput(
            structural_tag={
                "type": "structural_tag",
                "structures": [
                    {"begin": f"<tool_{i}>", "schema": {"type": "object"}, "end": "</tool>"}
                    for i in range(100)
                ],
                "triggers": ["<tool_"],
            }
        ),
        "limit",
    ),
    ("slow to compile", StructuredOutput(json_schema=slow_compile_schema()), "timeout"),
    ("slow masks", StructuredOutput(grammar='root ::= ([a-z] [0-9]?){0,900} "x"'), "slow_mask"),
]


@pytest.mark.parametrize(("name", "so", "reason"), PATHOLOGICAL, ids=[p[0] for p in PATHOLOGICAL])
def test_pathological_grammars_are_refused_in_time(name, so, reason, provider, service):
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(
            lambda: provider.submit(StructuredOutput(regex=f"[a-z]+{len(name)}")).result(60)
        )
        fut = provider.submit(so)
        with pytest.raises(GrammarError) as err:
            fut.result(timeout=DEADLINE_S + 30)
        elapsed = time.monotonic() - start
        assert good.result() is not None  # a concurrent well-behaved grammar still compiles
    assert err.value.reason == reason, str(err.value)
    assert 400 <= err.value.status < 500
    # a timeout is tried again, on the worker that replaces the one killed, before it is a
    # verdict (it may have been another tenant's load): two deadlines and a worker's start
    bound = 2 * DEADLINE_S + 20.0 if reason == "timeout" else DEADLINE_S + 1.0
    assert elapsed <= bound, f"{name}: verdict after {elapsed:.1f} s"
    assert service.pool.wait_ready(60)  # killed workers were replaced


def test_load_dependent_refusals_are_not_shared_between_tenants(service):
    spec = GrammarSpec(kind="json_schema", source=slow_compile_schema(63, bound=999))
    assert service.verdict(spec, "tenant-x").reason == "timeout"
    before = service.compiles
    assert service.verdict(spec, "tenant-x").reason == "timeout"  # remembered for x...
    assert service.compiles == before
    service.verdict(spec, "tenant-y")  # ... but y's request is compiled on its own (twice)
    assert service.compiles == before + 2
    assert service.pool.wait_ready(60)


def test_a_slow_grammars_family_is_refused_where_sound_and_probed_where_it_was_slow(service):
    """Near-duplicates of a grammar whose masks proved slow cannot buy a stall each: one with
    larger upper bounds is refused without a compile; one with a smaller bound or another exact
    count is probed first along the text that reached the slow mask (in Redis, the tenant's
    own), and refused for the slow mask it shows there. Another tenant's verdicts are its own."""

    def spec(count: int, upper: int) -> GrammarSpec:
        return GrammarSpec(kind="regex", source=f"([ab]\\n){{{count}}}(.?){{0,{upper}}}")

    first = service.verdict(spec(12, 900), "fam")
    assert first.reason == "slow_mask" and "a mask takes" in first.error
    before = service.compiles
    wider = service.verdict(spec(12, 950), "fam")
    assert wider.reason == "slow_mask" and "same structure" in wider.error
    assert service.compiles == before  # dominated: no compile
    narrower = service.verdict(spec(12, 850), "fam")
    assert narrower.reason == "slow_mask" and service.compiles == before + 1
    # decoding found what the probe's walk could not reach: the downgrade carries the path
    deep = spec(40, 900)
    assert service.verdict(deep, "fam").reason == "slow_mask"  # the family's path: 12 repeats
    service.downgrade(spec(60, 900), "fam", "shared", "slow_mask", "too slow", "a\n" * 60)
    assert service.verdict(spec(61, 900), "fam").reason == "slow_mask"
    before = service.compiles
    own = service.verdict(spec(12, 950), "other")  # not refused for "fam"'s record: probed
    assert own.reason == "slow_mask" and "a mask takes" in own.error
    assert service.compiles == before + 1
    assert "same structure" in service.verdict(spec(12, 960), "other").error  # its own record
    assert service.pool.wait_ready(60)


def test_an_offline_batch_queues_its_compiles_instead_of_refusing_them(llm):
    """The offline `LLM`'s batch is its own: a compile that finds no worker free, or its
    tenant's compiles at their cap, waits its turn; no request ends refused for capacity."""
    from services.compiler import provider_for

    tight = CompilerConfig(max_inflight_per_tenant=1, queue_wait_s=0.0)
    factory = provider_for(1, config=tight)
    offline = LLM(
        loaded=llm.engine.runner.loaded,
        kv_cache_memory=64 << 20,
        grammar_provider=factory,
        grammar_backend="xgrammar",
    )
    schemas = [person(f"field{i}") for i in range(6)]
    params = [
        SamplingParams(max_tokens=4, temperature=0, structured=StructuredOutput(json_schema=s))
        for s in schemas
    ]
    outs = offline.generate(["Give a person as JSON."] * len(schemas), params)
    assert [o.finish_reason for o in outs] == ["length"] * len(schemas), [o.warnings for o in outs]
    assert offline.engine.grammars.provider.busy_wait_s == float("inf")
    offline.engine.grammars.shutdown()


def test_twenty_concurrent_identical_registrations_compile_once(service):
    spec = GrammarSpec(kind="json_schema", source=person("rank"))
    before = service.compiles
    barrier = threading.Barrier(20)

    def register(i: int):
        barrier.wait()
        return service.register("tenant-sf", f"person-{i}", spec)

    with ThreadPoolExecutor(20) as pool:
        regs = list(pool.map(register, range(20)))
    assert service.compiles == before + 1
    assert len({r.grammar_id for r in regs}) == 20
    assert len(service.registrations.list("tenant-sf")) == 20


def test_tenants_cannot_see_each_others_grammars(service, provider):
    spec = GrammarSpec(kind="regex", source="[A-Z]{3}-[0-9]{5}")
    reg = service.register("tenant-a", "ticket", spec)
    compiled = provider.submit(StructuredOutput(grammar_id=reg.grammar_id), "tenant-a").result(30)
    assert compiled is not None
    missing = "gr_" + "0" * 24
    for gid in (reg.grammar_id, missing):
        with pytest.raises(GrammarError) as err:
            provider.submit(StructuredOutput(grammar_id=gid), "tenant-b").result(30)
        assert err.value.status == 404
        assert str(err.value) == f"structured.grammar_id: grammar_id: {gid!r} not found"
        with pytest.raises(GrammarError, match="not found"):
            service.resolve("tenant-b", gid)
    assert service.registrations.list("tenant-b") == []
    # The same spec registered by tenant B compiles again: no timing signal from A's entry.
    before = service.compiles
    service.register("tenant-b", "ticket", spec)
    assert service.compiles == before + 1


def test_engine_requests_use_registered_grammars_per_tenant(llm, provider, service):
    reg = service.register("tenant-e", "yesno", GrammarSpec(kind="choice", source=["yes", "no"]))
    served = LLM(
        loaded=llm.engine.runner.loaded, kv_cache_memory=64 << 20, grammar_provider=provider
    )
    params = SamplingParams(
        max_tokens=5, temperature=0, structured=StructuredOutput(grammar_id=reg.grammar_id)
    )
    engine = served.engine
    mine = engine.add_request("Is the sky blue?", params, tenant="tenant-e")
    theirs = engine.add_request("Is the sky blue?", params, tenant="tenant-f")
    while engine.has_unfinished():
        engine.step()
    ok, refused = engine.make_output(mine), engine.make_output(theirs)
    assert ok.text in ("yes", "no") and ok.finish_reason == "stop"
    assert refused.finish_reason == "error" and "not found" in refused.warnings[-1]


# -- property tests: whatever a tenant sends, a compiled grammar or a clear 4xx, never a hang ----

_REGEX_ALPHABET = "ab.()[]{}*+?|^$\\-,09dws"
_leaf = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "bogus"])},
    optional={
        "minLength": st.integers(-3, 50),
        "maxLength": st.integers(-3, 10**7),
        "pattern": st.text(_REGEX_ALPHABET, max_size=12),
        "enum": st.lists(st.one_of(st.text(max_size=5), st.integers()), max_size=4),
        "minimum": st.integers(-100, 100),
        "format": st.sampled_from(["email", "date-time", "uuid", "nonsense"]),
    },
)
_schemas = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=6), inner)},
            optional={"required": st.lists(st.text(max_size=6), max_size=3)},
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=4)}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/x", "#", "#/nope"])}),
    ),
    max_leaves=12,
)
_EBNF = 'root ::= "{" item ("," item)* "}"\nitem ::= [a-z]+ ":" [0-9]{1,3}\n'
_PROPERTY = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _answers_cleanly(provider: ServiceGrammarProvider, so: StructuredOutput) -> None:
    start = time.monotonic()
    try:
        compiled = provider.submit(so).result(timeout=DEADLINE_S + 60)
        assert compiled.handle is not None
    except GrammarError as err:
        assert 400 <= err.status < 500, err
        assert str(err).startswith("structured."), err
    assert time.monotonic() - start < DEADLINE_S + 60


@_PROPERTY
@given(schema=_schemas)
def test_random_schemas_get_a_grammar_or_a_clear_error(provider, schema):
    _answers_cleanly(provider, StructuredOutput(json_schema=schema))


@_PROPERTY
@given(pattern=st.text(_REGEX_ALPHABET, max_size=30))
def test_random_regexes_get_a_grammar_or_a_clear_error(provider, pattern):
    _answers_cleanly(provider, StructuredOutput(regex=pattern))


@_PROPERTY
@given(data=st.data())
def test_mutated_ebnf_gets_a_grammar_or_a_clear_error(provider, data):
    at = data.draw(st.integers(0, len(_EBNF)))
    cut = data.draw(st.integers(0, 4))
    insert = data.draw(st.text('()[]{}*+?|":=,az09 \n\\', max_size=4))
    grammar = _EBNF[:at] + insert + _EBNF[at + cut :]
    _answers_cleanly(provider, StructuredOutput(grammar=grammar, grammar_syntax="ebnf"))


@_PROPERTY
@given(data=st.data())
def test_mutated_real_schemas_get_a_grammar_or_a_clear_error(provider, data):
    files = sorted(MASKBENCH.glob("*.json"))
    if not files:
        pytest.skip("the maskbench data set is not next to the repository")
    schema = json.loads(data.draw(st.sampled_from(files)).read_text())["schema"]
    text = json.dumps(schema)
    at = data.draw(st.integers(0, len(text)))
    mutated = text[:at] + data.draw(st.sampled_from(['"', "{", "}", "[", "1", ":", ""])) + text[at:]
    try:
        candidate = json.loads(mutated)
    except json.JSONDecodeError:
        candidate = schema
    if isinstance(candidate, dict):
        _answers_cleanly(provider, StructuredOutput(json_schema=candidate))
