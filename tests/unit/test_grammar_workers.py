"""The threads that run grammar work under a deadline (services/grammar/workers.py), and the
families a slow grammar's verdict reaches (grammar_registry/family.py)."""

from __future__ import annotations

import os
import time

import pytest

from grammar_registry.family import family_of
from grammar_registry.specs import GrammarSpec
from services.grammar.workers import GrammarWorkers


def spin(seconds: float) -> str:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    return "spun"


def test_a_straggler_is_replaced_demoted_and_counted_until_it_returns():
    workers = GrammarWorkers(1)
    try:
        slow = workers.submit([(lambda: spin(0.6), "hostile")])[0]
        assert not workers.wait([slow], 0.05)  # past its deadline
        workers.straggle(slow)
        assert workers.stragglers("hostile") == 1
        # the one worker was replaced: other work runs while the straggler still spins
        quick = workers.submit([(lambda: 1 + 1, "victim")])[0]
        assert workers.wait([quick], 2.0) and quick.result == 2 and not slow.done
        assert slow.cpu_seconds() > 0.01  # read live from its thread
        workers.demote(slow)
        worker = slow._worker
        assert worker is not None and worker.demoted
        idle = os.sched_getscheduler(worker.native_id) == getattr(os, "SCHED_IDLE", -1)
        assert idle or os.getpriority(os.PRIO_PROCESS, worker.native_id) == 19
        assert workers.wait([slow], 10.0) and slow.result == "spun" and slow.seconds >= 0.6
        assert workers.stragglers("hostile") == 0
    finally:
        workers.shutdown()


def test_a_job_that_raises_reports_it_and_the_worker_goes_on():
    workers = GrammarWorkers(1)
    try:

        def boom() -> None:
            raise ValueError("the grammar's own failure")

        bad, good = workers.submit([(boom, "t"), (lambda: "fine", "t")])
        assert workers.wait([bad, good], 2.0)
        assert isinstance(bad.error, ValueError) and good.result == "fine"
    finally:
        workers.shutdown()


def test_shut_down_workers_take_no_more_jobs():
    workers = GrammarWorkers(1)
    workers.shutdown()
    with pytest.raises(RuntimeError):
        workers.submit([(lambda: None, "t")])


def regex(source: str):
    return family_of(GrammarSpec(kind="regex", source=source))


def test_a_family_is_the_structure_and_its_counts_in_order():
    deep = regex(r"([ab]\n){12}(.?){0,1000}")
    assert deep is not None and deep.counts == (12, 0, 1000)
    assert deep.upper == (False, False, True)
    for variant in (r"([ab]\n){13}(.?){0,1000}", r"([ab]\n){12}(.?){0,999}"):
        other = regex(variant)
        assert other is not None and other.key == deep.key
    assert regex(r"([ab]\n){12}(.?){0,}").key != deep.key  # an open bound is structure
    assert regex(r"a1b2") is None  # literal digits are not counts
    schema = {"type": "string", "maxLength": 12, "minLength": 2, "pattern": "[a-z]{3}"}
    fam = family_of(GrammarSpec(kind="json_schema", source=schema))
    assert fam is not None and sorted(fam.counts) == [2, 3, 12]
    assert sum(fam.upper) == 1  # maxLength alone is an upper bound


def test_only_larger_upper_bounds_with_the_rest_equal_are_dominated():
    slow = (12, 0, 1000)
    assert regex(r"([ab]\n){12}(.?){0,1000}").dominates(slow)  # type: ignore[union-attr]
    bigger = regex(r"([ab]\n){12}(.?){0,900}")
    assert bigger is not None and bigger.dominates((12, 0, 800))
    assert not bigger.dominates(slow)  # a smaller upper bound: probed, not refused
    assert not regex(r"([ab]\n){13}(.?){0,1000}").dominates(slow)  # type: ignore[union-attr]
    assert not regex(r"([ab]\n){12}(.?){1,1000}").dominates(slow)  # type: ignore[union-attr]


# -- the sandbox pool's deadline is the job's CPU time -------------------------------------------


class _Conn:
    def __init__(self, answer_at: float) -> None:
        self.answer_at = answer_at

    def poll(self, timeout: float) -> bool:
        now = time.monotonic()
        if now + timeout >= self.answer_at:
            time.sleep(max(0.0, self.answer_at - now))
            return True
        time.sleep(timeout)
        return False


class _Process:
    """A worker whose job answers at `answer_at`, burning `cpu_per_s` of CPU a second."""

    def __init__(self, answer_in: float, cpu_per_s: float | None) -> None:
        self.start = time.monotonic()
        self.conn = _Conn(self.start + answer_in)
        self.cpu_per_s = cpu_per_s

    def cpu_seconds(self) -> float | None:
        if self.cpu_per_s is None:
            return None
        return self.cpu_per_s * (time.monotonic() - self.start)


def test_a_job_slowed_by_the_load_is_not_timed_out_and_a_costly_one_is():
    from services.sandbox.pool import LOAD_GRACE, WorkerPool

    deadline = 0.2
    # a third of a core (the host is busy): past its deadline of wall time, within its CPU
    assert WorkerPool._answered(_Process(1.5 * deadline, cpu_per_s=0.3), deadline)  # type: ignore[arg-type]
    # the job's own CPU reaches the deadline first: timed out before it would answer
    start = time.monotonic()
    assert not WorkerPool._answered(_Process(3 * deadline, cpu_per_s=1.0), deadline)  # type: ignore[arg-type]
    assert time.monotonic() - start < 2 * deadline
    # starved so long that even the grace is spent: timed out at LOAD_GRACE deadlines
    start = time.monotonic()
    assert not WorkerPool._answered(_Process(10 * deadline, cpu_per_s=0.01), deadline)  # type: ignore[arg-type]
    assert time.monotonic() - start < (LOAD_GRACE + 0.5) * deadline
    # where the CPU time cannot be read, the wall clock decides
    assert not WorkerPool._answered(_Process(1.5 * deadline, cpu_per_s=None), deadline)  # type: ignore[arg-type]


def test_a_blob_that_takes_too_long_to_write_is_dropped_not_charged_to_the_grammar():
    """Writing a compiled grammar's blob runs beside, within its budget: past it the verdict
    comes without the blob (and the worker asks to be replaced, which stops the writer)."""
    from types import SimpleNamespace

    from services.compiler.compile_job import _with_blob

    slow = SimpleNamespace(serialize_json=lambda: time.sleep(2.0) or "{}")
    quick = SimpleNamespace(serialize_json=lambda: '{"grammar": 1}')
    backend = SimpleNamespace(load=lambda text: None)
    verdict = {"ok": True, "compile_s": 0.01}
    start = time.monotonic()
    late = _with_blob(verdict, backend, slow, budget_s=0.1)
    assert time.monotonic() - start < 1.0
    assert late["ok"] and late["recycle"] and "blob" not in late
    done = _with_blob(verdict, backend, quick, budget_s=1.0)
    assert done["blob"] and done["load_s"] >= 0 and "recycle" not in done
