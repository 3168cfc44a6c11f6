"""Where compiled grammars come from. The engine asks a `GrammarProvider` and waits on a future.

`LocalGrammarProvider` compiles in-process on a worker thread with a small LRU in front (the plain
twin, `grammar_workers=0`); the compile service's provider (services/compiler/: killable worker
processes, limits, a probe, the Redis cache) implements the same interface. Whoever builds an
engine hands it one, or a `ProviderFactory` that makes one from the model's backends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from services.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError
from services.grammar.canonical import structured_key
from services.grammar.structured import StructuredOutput

if TYPE_CHECKING:
    from services.grammar.backends import Backends


class GrammarProvider(Protocol):
    def shutdown(self) -> None: ...

    def submit(self, spec: StructuredOutput, tenant: str = "default") -> Future[CompiledGrammar]:
        """A future of the compiled grammar; it fails with `GrammarError` for unusable input.
        `tenant` scopes `grammar_id` lookups and compile quotas."""
        ...

    def downgrade(
        self,
        spec: StructuredOutput,
        tenant: str,
        error: GrammarError,
        backend: str = "xgrammar",
        path: str = "",
    ) -> None:
        """The grammar `backend` compiled for `spec` proved too costly while decoding: refuse
        it from now on with `error` (for `tenant` at least; under `auto` another backend may
        take the spec). `path`: the output that reached the costly mask (its family's probes
        replay it). Must not block: the engine thread calls it."""
        ...


# Makes an engine's provider from the model's backends, which exist only once the model is loaded.
ProviderFactory = Callable[["Backends"], GrammarProvider]


class LocalGrammarProvider:
    def __init__(self, backend: GrammarBackend, max_entries: int = 256, workers: int = 1) -> None:
        self.backend = backend
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self.num_compiles = 0

    def submit(self, spec: StructuredOutput, tenant: str = "default") -> Future[CompiledGrammar]:
        try:
            key = structured_key(spec)
        except GrammarError as exc:  # no canonical form: nothing to cache either
            refused: Future[CompiledGrammar] = Future()
            refused.set_exception(exc)
            return refused
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
        self,
        spec: StructuredOutput,
        tenant: str,
        error: GrammarError,
        backend: str = "xgrammar",
        path: str = "",
    ) -> None:
        refused: Future[CompiledGrammar] = Future()
        refused.set_exception(error)
        with self._lock:
            self._cache[structured_key(spec)] = refused

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
