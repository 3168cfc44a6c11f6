"""Batch records and progress (services/batches/jobs.py) on fakeredis: lines that cannot run
name their line and reason, a line's output is written once however often it finishes, a cancel
is never undone by the runner's progress; the batch class yields in the fair scheduler."""

from __future__ import annotations

import json

import fakeredis
import pytest

from services.batches.jobs import QUEUE, BatchStore, CreateBatch, read_lines
from services.engine.fairness import BATCH_SUFFIX, FairShares

URL = "/v1/chat/completions"


def line(cid, url=URL, **extra):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {}, **extra})


def test_lines_that_cannot_run_go_to_the_error_file_naming_line_and_reason():
    data = "\n".join(
        [
            line("a"),
            "not json",
            json.dumps({"method": "POST", "url": URL, "body": {}}),
            line("a"),
            line("b", url="/v1/embeddings"),
            line("c", method="GET"),
            json.dumps({"custom_id": "d", "url": URL, "body": "x"}),
            "",
            line("e"),
        ]
    ).encode()
    lines, errors = read_lines(data, URL)
    assert [(x.number, x.custom_id) for x in lines] == [(1, "a"), (9, "e")]
    got = [(e["error"]["line"], e["custom_id"], e["error"]["code"]) for e in errors]
    assert got == [
        (2, None, "invalid_json"),
        (3, None, "missing_custom_id"),
        (4, "a", "duplicate_custom_id"),
        (5, "b", "invalid_url"),
        (6, "c", "invalid_method"),
        (7, "d", "invalid_body"),
    ]


@pytest.fixture
def store():
    return BatchStore(fakeredis.FakeRedis())


def create(store, tenant="t"):
    body = CreateBatch(input_file_id="file-1", endpoint=URL, completion_window="24h")
    return store.create(tenant, body, total=3)


def test_a_batch_is_queued_scoped_and_its_lines_written_once(store):
    record = create(store)
    assert store.client.lrange(QUEUE, 0, -1) == [f"t/{record.id}".encode()]
    assert store.get("other", record.id) is None and store.list("other") == []
    assert store.in_flight("t") == 1 and record.expires_at - record.created_at == 24 * 3600
    assert store.finish(record.id, 1, {"custom_id": "a"}, failed=False)
    assert not store.finish(record.id, 1, {"custom_id": "a"}, failed=False)  # ran twice
    assert store.finish(record.id, 2, {"custom_id": "b"}, failed=True)
    assert store.done(record.id) == {1, 2} and store.counts(record.id) == (1, 1)
    assert store.outputs(record.id, "out") == b'{"custom_id": "a"}\n'
    store.forget(record.id)
    assert store.done(record.id) == set()


def test_updates_apply_to_the_record_as_it_is_now(store):
    record = create(store)

    def cancel(r):
        r.status = "cancelling"

    def progress(r):
        r.request_counts["completed"] = 2
        if r.status == "validating":
            r.status = "in_progress"

    store.update("t", record.id, cancel)
    after = store.update("t", record.id, progress)
    assert after.status == "cancelling" and after.request_counts["completed"] == 2
    assert store.update("t", "batch_nope", progress) is None


def test_the_batch_class_gets_what_interactive_tenants_leave():
    shares = FairShares({"acme": 1.0})
    batch = "acme" + BATCH_SUFFIX
    shares.charge(batch, 10)
    shares.charge("acme", 1000)
    assert shares.next_tenant([batch, "acme"]) == "acme"  # 10 tokens weigh more than 1000
    assert shares.split(8, {batch: None, "acme": 1}) == {batch: 7, "acme": 1}  # alone: all left


def test_a_line_nested_past_the_parsers_depth_is_an_error_line_not_a_crash():
    data = ("[" * 100_000 + "\n" + line("ok")).encode()
    lines, errors = read_lines(data, URL)
    assert [x.custom_id for x in lines] == ["ok"]
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [(1, "invalid_json")]
