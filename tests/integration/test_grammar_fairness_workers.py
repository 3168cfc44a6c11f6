"""Fair shares of grammar resolution with real compile workers (the grammar path): one
tenant's grammars that run to the deadline do not hold up another tenant's, and the worker
restarts they cause are that tenant's to pay. The service is shaped as the grammar deployment
builds it: two workers, one compile in flight per tenant.
"""

from __future__ import annotations

import time

import pytest
import xgrammar as xgr
from hostile import slow_compile_schema

from grammar_registry import GrammarSpec
from services import StructuredOutput
from services.compiler import CompilerConfig, CompileService, ServiceGrammarProvider
from services.grammar import GrammarError
from services.grammar.xgrammar_backend import XGrammarBackend

DEADLINE_S = 1.5


@pytest.fixture(scope="module")
def backend(tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer_info=xgr.TokenizerInfo.from_huggingface(tokenizer))


@pytest.fixture(scope="module")
def service(backend):
    config = CompilerConfig(workers=2, deadline_s=DEADLINE_S, max_inflight_per_tenant=1)
    svc = CompileService(backend.tokenizer_info, config)
    assert svc.pool.wait_ready()
    yield svc
    svc.close()


def test_a_tenant_at_the_deadline_does_not_hold_up_another(backend, service):
    provider = ServiceGrammarProvider(backend, service)
    try:
        slow = [
            provider.submit(StructuredOutput(json_schema=slow_compile_schema(64 - i)), "tenant-a")
            for i in range(12)  # more than the provider's threads
        ]
        end = time.monotonic() + 5
        while provider.dispatcher.snapshot()["parked"] < 10 and time.monotonic() < end:
            time.sleep(0.01)
        # one compiles on a worker, the others wait holding no thread (one may be asking again)
        snap = provider.dispatcher.snapshot()
        assert snap["parked"] >= 10 and snap["running"] <= 2, snap
        start = time.monotonic()
        fine = provider.submit(StructuredOutput(regex="[0-9]{3}-[a-z]{2}"), "tenant-b")
        assert fine.result(timeout=30) is not None
        assert time.monotonic() - start < DEADLINE_S - 0.3  # A's compile has not even ended
    finally:
        provider.shutdown()
    for fut in slow:  # the parked ones are answered at shutdown, the running one by its worker
        with pytest.raises(GrammarError):
            fut.result(timeout=DEADLINE_S + 10)
    assert service.pool.wait_ready(60)


def test_the_restarts_a_tenant_causes_are_charged_to_it(service):
    assert service.pool.wait_ready(60)
    slow = GrammarSpec(kind="json_schema", source=slow_compile_schema(64))
    assert service.verdict(slow, "tenant-c").reason == "timeout"
    assert service.pool.restarting("tenant-c") == 1  # a worker start takes seconds
    mine = GrammarSpec(kind="regex", source="[a-z]{3}-c")
    refused = service.verdict(mine, "tenant-c")
    assert refused.reason == "busy" and "restarting" in refused.error, refused
    assert service.verdict(GrammarSpec(kind="regex", source="[a-z]{3}-d"), "tenant-d").ok
    assert service.pool.wait_ready(60)
    assert service.verdict(mine, "tenant-c").ok  # paid: compiles again
    assert service.pool.charged_s["tenant-c"] > 0.1 and "tenant-d" not in service.pool.charged_s
