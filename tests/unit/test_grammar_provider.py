import threading
import time

from services import SamplingParams, StructuredOutput
from services.grammar.backend import CompiledGrammar
from services.grammar.backends import Backends
from services.grammar.canonical import structured_key
from services.grammar.provider import LocalGrammarProvider


class CountingBackend:
    vocab_size = 8

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def compile(self, spec):
        with self.lock:
            self.calls += 1
        time.sleep(0.05)
        return CompiledGrammar(handle=spec.kind)


def test_identical_specs_compile_once_and_options_are_part_of_the_key():
    backend = CountingBackend()
    provider = LocalGrammarProvider(backend, max_entries=2)  # type: ignore[arg-type]
    futures = [provider.submit(StructuredOutput(regex="a+")) for _ in range(20)]
    assert {f.result().handle for f in futures} == {"regex"}
    assert backend.calls == 1
    provider.submit(StructuredOutput(regex="a+", max_whitespace_cnt=4)).result()
    assert backend.calls == 2
    provider.submit(StructuredOutput(choice=["x"])).result()
    provider.submit(StructuredOutput(regex="a+")).result()  # evicted by the bound of 2: again
    assert backend.calls == 4


def test_structured_key_is_canonical():
    a = StructuredOutput(json_schema={"b": 1, "a": {"y": 2, "x": 1}})
    b = StructuredOutput(json_schema={"a": {"x": 1, "y": 2}, "b": 1})
    assert structured_key(a) == structured_key(b)
    assert structured_key(a) != structured_key(StructuredOutput(json_schema={"a": 1}))


def test_a_structured_request_holds_the_one_canonical_key():
    from services.engine.request import Request
    from services.engine.structured.manager import GrammarManager

    provider = LocalGrammarProvider(CountingBackend())  # type: ignore[arg-type]
    manager = GrammarManager(Backends(None, 8, []), provider, 4)
    a = StructuredOutput(json_schema={"b": 1, "a": 2})
    reqs = []
    for i, spec in enumerate(
        [
            a,
            StructuredOutput(json_schema={"a": 2, "b": 1}),
            StructuredOutput(json_schema=a.json_schema, max_whitespace_run=3),
        ]
    ):
        req = Request(f"r{i}", [1], SamplingParams(structured=spec), detokenizer=None)  # type: ignore[arg-type]
        manager.attach(req)
        reqs.append(req)
    keys = [r.structured.key for r in reqs]
    assert keys[0] == keys[1] == structured_key(a) and keys[2] != keys[0]
    assert all(r.structured.future.result(timeout=5).handle == "json_schema" for r in reqs)
    assert not reqs[0].ready  # compiled, waiting for the engine to give it a state
    manager.shutdown()


def test_a_downgrade_goes_where_the_backend_that_compiled_it_lives():
    """llguidance's grammars are refused where they were built (LocalBuilds), xgrammar's in the
    compile service's verdicts."""
    from types import SimpleNamespace

    from grammar_registry import GrammarSpec
    from services.compiler import ServiceGrammarProvider
    from services.grammar import GrammarError

    calls: list[tuple[str, str]] = []

    class Local:
        def downgrade(self, spec, tenant, error):
            calls.append(("local", tenant))

        def close(self):
            pass

    service = SimpleNamespace(
        key=lambda spec, scope="shared": f"{scope}:{spec.canonical()}",
        resolve=lambda tenant, gid: GrammarSpec(kind="regex", source=gid),
        downgrade=lambda spec, tenant, scope, reason, error, path: calls.append(
            ("service", tenant)
        ),
        close=lambda: None,
    )
    provider = ServiceGrammarProvider(None, service, local=Local())  # type: ignore[arg-type]
    error = GrammarError("structured.regex: masks slower than the budget", "slow_mask", 422)
    spec = StructuredOutput(regex="a+")
    provider.downgrade(spec, "t1", error, "llguidance")
    provider.downgrade(spec, "t2", error, "xgrammar")
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == [("local", "t1"), ("service", "t2")]
    provider.shutdown()


def test_the_manager_takes_a_provider_or_what_makes_one_from_the_backends():
    """An engine is handed its provider, or a factory called with the model's backends on the
    first structured request (a provider's class is such a factory)."""
    from services.engine.structured.manager import GrammarManager

    backends = Backends(None, 8, [])
    made: list = []

    def factory(given):
        made.append(given)
        return LocalGrammarProvider(CountingBackend())  # type: ignore[arg-type]

    lazy = GrammarManager(backends, factory, 4)
    assert not made  # nothing built for unconstrained traffic
    assert isinstance(lazy.provider, LocalGrammarProvider) and made == [backends]
    as_class = GrammarManager(backends, LocalGrammarProvider, 4)
    assert as_class.provider.backend is backends
    given = LocalGrammarProvider(CountingBackend())  # type: ignore[arg-type]
    assert GrammarManager(backends, given, 4).provider is given
    for manager in (lazy, as_class):
        manager.shutdown()
