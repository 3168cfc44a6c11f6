"""Grammar registry pieces without a compiler: specs and keys, static limits, the verdict cache,
tenant registrations (fakeredis here; the integration tests use a real Redis)."""

from __future__ import annotations

import json

import fakeredis
import pytest

from grammar_registry import (
    GrammarLimits,
    GrammarOptions,
    GrammarSpec,
    LimitExceeded,
    LRUBytes,
    RedisVerdicts,
    RegistrationCaps,
    RegistrationError,
    RegistrationStore,
    Verdict,
    check_limits,
    grammar_key,
)

KEY_ARGS = {"backend_version": "x-0.2.9", "serialization": "v18", "tokenizer": "ab" * 32}
SECRET = b"registry-test-verdict-secret"


def schema(source: dict) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", source=source)


def test_canonical_form_ignores_key_order_and_irrelevant_options():
    a = schema({"type": "object", "properties": {"a": {"type": "string"}}})
    b = schema({"properties": {"a": {"type": "string"}}, "type": "object"})
    assert a.canonical() == b.canonical()
    # whitespace options mean nothing to a regex
    r1 = GrammarSpec(kind="regex", source="a+", options=GrammarOptions(max_whitespace_cnt=2))
    r2 = GrammarSpec(kind="regex", source="a+")
    assert r1.digest() == r2.digest()
    # ... but they do change a JSON grammar
    c = schema({"type": "object"}).model_copy(update={"options": GrammarOptions(compact=True)})
    assert c.digest() != schema({"type": "object"}).digest()


def test_key_carries_versions_tokenizer_scope_and_kind():
    spec = schema({"type": "integer"})
    key = grammar_key(spec, scope="shared", **KEY_ARGS)
    assert key.startswith("structserve:grammar:v1:x-0.2.9:v18:abababab")
    assert ":shared:json_schema:" in key
    assert key != grammar_key(spec, scope="tenant-a", **KEY_ARGS)
    assert key != grammar_key(spec, scope="shared", **{**KEY_ARGS, "serialization": "v19"})
    assert key != grammar_key(spec, scope="shared", **{**KEY_ARGS, "tokenizer": "cd" * 32})


@pytest.mark.parametrize(
    ("kind", "source"),
    [("json_schema", "not a dict"), ("regex", 3), ("choice", [1, 2]), ("json_object", {})],
)
def test_spec_rejects_a_source_of_the_wrong_shape(kind, source):
    with pytest.raises(ValueError, match=kind):
        GrammarSpec(kind=kind, source=source)


def _deep(n: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(n):
        node = {"type": "object", "properties": {"x": node}}
    return node


@pytest.mark.parametrize(
    ("spec", "limit", "path"),
    [
        (schema(_deep(40)), "max_depth", "#"),
        (schema({"type": "string", "maxLength": 10**7}), "max_length_bound", "#/maxLength"),
        (schema({"enum": list(range(5000))}), "max_enum_values", "#"),
        (schema({"anyOf": [{"type": "string"}] * 100}), "max_branches", "#/anyOf"),
        (
            schema({"properties": {"p": {"type": "string", "pattern": "(a{0,50}){0,50}"}}}),
            "max_repeat",
            "#/properties/p/pattern",
        ),
        (GrammarSpec(kind="regex", source="(.{0,50}){0,50}"), "max_repeat", "#"),
        (GrammarSpec(kind="regex", source="x" * 5000), "max_regex_bytes", "#"),
        (GrammarSpec(kind="regex", source="a\x00b"), "nul_bytes", "#"),
        (GrammarSpec(kind="choice", source=[str(i) for i in range(2000)]), "max_enum_values", "#"),
        (GrammarSpec(kind="ebnf", source='root ::= "a"{0,5000}'), "max_repeat", "#"),
        (
            GrammarSpec(
                kind="structural_tag",
                source={
                    "type": "structural_tag",
                    "structures": [
                        {"begin": f"<{i}>", "schema": {}, "end": "</>"} for i in range(100)
                    ],
                    "triggers": ["<"],
                },
            ),
            "max_tags",
            "#",
        ),
        (
            schema({"type": "object", "properties": {f"p{i}": {} for i in range(6000)}}),
            "max_properties",
            "#",
        ),
    ],
)
def test_limits_name_the_limit_the_value_and_the_path(spec, limit, path):
    with pytest.raises(LimitExceeded) as err:
        check_limits(spec, GrammarLimits())
    assert err.value.limit == limit
    assert err.value.path == path
    assert limit in str(err.value) and path in str(err.value)


@pytest.mark.parametrize(
    "spec",
    [
        schema(_deep(10)),
        schema({"type": "string", "maxLength": 255, "pattern": "^[a-z]{1,32}$"}),
        GrammarSpec(kind="regex", source=r"\d{3}-\d{4}"),
        GrammarSpec(kind="regex", source=r"[({]{5}(ab){3}"),  # braces inside a class are literal
        GrammarSpec(kind="ebnf", source='root ::= "a" [0-9]{1,10}'),
    ],
)
def test_ordinary_specs_pass_the_limits(spec):
    check_limits(spec, GrammarLimits())


def test_limits_are_configurable():
    spec = GrammarSpec(kind="regex", source="a{0,20}")
    check_limits(spec, GrammarLimits())
    with pytest.raises(LimitExceeded, match="max_repeat=10"):
        check_limits(spec, GrammarLimits(max_repeat=10))


def test_verdict_round_trips_and_refuses_foreign_bytes():
    v = Verdict(ok=True, warnings=["#/x: y"], compile_s=0.5, load_s=0.1, blob_bytes=3, blob=b"abc")
    assert Verdict.decode(v.encode()) == v
    refusal = Verdict(ok=False, reason="timeout", error="too slow")
    assert Verdict.decode(refusal.encode()) == refusal
    with pytest.raises(ValueError):
        Verdict.decode(b"{'pickled': 1}")


def test_a_verdict_names_its_backend_and_one_stored_before_that_reads_as_xgrammar():
    guided = Verdict(ok=True, mask_ms=0.2, backend="llguidance")
    assert Verdict.decode(guided.encode()).backend == "llguidance"
    head = json.dumps({"ok": True, "warnings": [], "compile_s": 0.1}).encode()
    older = b"SSV1" + len(head).to_bytes(4, "big") + head  # a header without `backend`
    assert Verdict.decode(older).backend == "xgrammar"


def test_lru_is_bounded_in_bytes():
    lru = LRUBytes(100)
    for i in range(5):
        lru.put(f"k{i}", i, 30)
    assert lru.bytes <= 100 and len(lru) == 3
    assert lru.get("k0") is None and lru.get("k4") == 4
    lru.get("k2")
    lru.put("k5", 5, 30)  # evicts the least recently used (k3), not k2
    assert lru.get("k2") == 2 and lru.get("k3") is None
    lru.put("huge", 0, 1000)  # larger than the whole cache: not stored, nothing evicted
    assert lru.get("huge") is None and lru.get("k5") == 5


def test_redis_verdicts_ttl_and_failure_ttl():
    r = fakeredis.FakeRedis()
    store = RedisVerdicts(r, ttl_s=1000, failure_ttl_s=10, secret=SECRET)
    store.put("ok", Verdict(ok=True))
    store.put("bad", Verdict(ok=False, reason="invalid", error="x"))
    assert 990 < r.ttl("ok") <= 1000
    assert 0 < r.ttl("bad") <= 10
    assert store.get("ok") == Verdict(ok=True)


def test_redis_verdicts_drop_an_oversized_blob_but_keep_the_verdict():
    r = fakeredis.FakeRedis()
    store = RedisVerdicts(r, max_entry_bytes=1000, secret=SECRET)
    store.put("k", Verdict(ok=True, blob=b"x" * 5000, blob_bytes=5000))
    got = store.get("k")
    assert got is not None and got.ok and got.blob is None


def test_unreadable_entries_and_redis_errors_are_misses():
    r = fakeredis.FakeRedis()
    r.set("k", b"garbage")
    store = RedisVerdicts(r, secret=SECRET)
    assert store.get("k") is None

    class Broken:
        def get(self, *_a, **_k):
            raise ConnectionError("redis is down")

        set = getrange = get

    down = RedisVerdicts(Broken(), backoff_s=60, secret=SECRET)
    assert down.get("k") is None
    assert down.put("k", Verdict(ok=True)) is False
    assert down.errors == 1  # the second call did not even try: backing off


@pytest.fixture(params=["fakeredis", "dict"])
def store(request):
    client = fakeredis.FakeRedis() if request.param == "fakeredis" else None
    return RegistrationStore(client, RegistrationCaps(max_registrations=3, max_bytes=2000))


def test_registrations_are_scoped_by_tenant(store):
    spec = GrammarSpec(kind="regex", source="[a-z]+")
    reg = store.add("tenant-a", "words", spec)
    assert store.get("tenant-a", reg.grammar_id).spec == spec
    assert [r.name for r in store.list("tenant-a")] == ["words"]
    assert store.list("tenant-b") == []
    for op in (store.get, store.delete):
        with pytest.raises(RegistrationError) as err:
            op("tenant-b", reg.grammar_id)
        assert err.value.status == 404
    store.delete("tenant-a", reg.grammar_id)
    with pytest.raises(RegistrationError):
        store.get("tenant-a", reg.grammar_id)


def test_registration_caps_and_names(store):
    spec = GrammarSpec(kind="regex", source="[a-z]+")
    store.add("t", "one", spec)
    with pytest.raises(RegistrationError) as err:
        store.add("t", "one", spec)
    assert err.value.status == 409
    store.add("t", "two", spec)
    store.add("t", "three", spec)
    with pytest.raises(RegistrationError, match="cap of 3") as err:
        store.add("t", "four", spec)
    assert err.value.status == 429
    big = GrammarSpec(kind="regex", source="a" * 2500)
    with pytest.raises(RegistrationError, match="bytes"):
        store.add("other", "big", big)
    assert json.loads(store.list("t")[0].model_dump_json())["name"] == "one"


def test_registrations_answer_503_while_the_store_is_down():
    class Down:
        def __getattr__(self, _name):
            def fail(*_a):
                raise ConnectionError("connection refused")

            return fail

    store = RegistrationStore(Down())
    for call in (
        lambda: store.add("t", "n", GrammarSpec(kind="regex", source="a")),
        lambda: store.get("t", "gr_x"),
        lambda: store.list("t"),
        lambda: store.delete("t", "gr_x"),
    ):
        with pytest.raises(RegistrationError, match="unavailable") as err:
            call()
        assert err.value.status == 503
