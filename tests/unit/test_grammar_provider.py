import threading
import time

from services import StructuredOutput
from services.engine.grammar.backend import CompiledGrammar
from services.engine.grammar.provider import LocalGrammarProvider, spec_key


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


def test_spec_key_is_canonical():
    a = StructuredOutput(json_schema={"b": 1, "a": {"y": 2, "x": 1}})
    b = StructuredOutput(json_schema={"a": {"x": 1, "y": 2}, "b": 1})
    assert spec_key(a) == spec_key(b)
    assert spec_key(a) != spec_key(StructuredOutput(json_schema={"a": 1}))
