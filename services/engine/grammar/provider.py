"""Where compiled grammars come from. The engine asks a `GrammarProvider` and waits on a future.

`LocalGrammarProvider` compiles in-process on a worker thread with a small LRU in front; the grammar
registry's compile service (killable worker processes, Redis cache, limits) implements the same
interface and replaces it without touching the engine.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from services.engine.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError
from services.engine.params import StructuredOutput


class GrammarProvider(Protocol):
    def shutdown(self) -> None: ...

    def submit(self, spec: StructuredOutput, tenant: str = "default") -> Future[CompiledGrammar]:
        """A future of the compiled grammar; it fails with `GrammarError` for unusable input.
        `tenant` scopes `grammar_id` lookups and compile quotas."""
        ...

    def downgrade(
        self, spec: StructuredOutput, tenant: str, error: GrammarError, backend: str = "xgrammar"
    ) -> None:
        """The grammar `backend` compiled for `spec` proved too costly while decoding: refuse
        it from now on with `error` (for `tenant` at least; under `auto` another backend may
        take the spec). Must not block: the engine thread calls it."""
        ...


def spec_key(spec: StructuredOutput) -> str:
    """A canonical key: sorted JSON of the spec and its options."""
    data = {k: v for k, v in vars(spec).items() if v is not None and v is not False}
    if isinstance(spec.json_schema, type) and hasattr(spec.json_schema, "model_json_schema"):
        data["json_schema"] = spec.json_schema.model_json_schema()
    return json.dumps(data, sort_keys=True, default=str)


class LocalGrammarProvider:
    def __init__(self, backend: GrammarBackend, max_entries: int = 256, workers: int = 1) -> None:
        self.backend = backend
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self.num_compiles = 0

    def submit(self, spec: StructuredOutput, tenant: str = "default") -> Future[CompiledGrammar]:
        key = spec_key(spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            self.num_compiles += 1
            fut = self._pool.submit(self.backend.compile, spec)
            self._cache[key] = fut
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
            return fut

    def downgrade(
        self, spec: StructuredOutput, tenant: str, error: GrammarError, backend: str = "xgrammar"
    ) -> None:
        refused: Future[CompiledGrammar] = Future()
        refused.set_exception(error)
        with self._lock:
            self._cache[spec_key(spec)] = refused

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
