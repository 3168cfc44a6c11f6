"""Tenants' files (services/batches/files.py, deployments/files_api.py) on fakeredis and a
directory: JSONL checked line by line, caps, scoping by tenant, the multipart form the `openai`
client sends."""

from __future__ import annotations

import fakeredis
import httpx
import pytest

from deployments.answers import ApiError
from deployments.files_api import form_fields
from services.batches.files import FileCaps, FileError, FileStore, LocalBlobs

LINE = b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def store(tmp_path):
    caps = FileCaps(max_file_bytes=4096, max_files=3, max_bytes=6000)
    return FileStore(fakeredis.FakeRedis(), LocalBlobs(tmp_path), caps)


def error(fn, *args):
    with pytest.raises(FileError) as err:
        fn(*args)
    return err.value.status, str(err.value)


def test_a_tenants_files_are_its_own(store):
    record = store.add("a", "in.jsonl", "batch", LINE * 3)
    assert record.lines == 3 and record.view()["object"] == "file"
    assert store.content("a", record.id) == LINE * 3
    assert error(store.get, "b", record.id)[0] == error(store.get, "b", "file-nope")[0] == 404
    assert error(store.content, "b", record.id)[0] == error(store.delete, "b", record.id)[0] == 404
    assert [r.id for r in store.list("a")] == [record.id] and store.list("b") == []
    store.delete("a", record.id)
    assert error(store.get, "a", record.id)[0] == 404 and store.list("a") == []


def test_batch_files_are_jsonl_objects_within_caps(store):
    assert "not JSONL" in error(store.add, "a", "x", "batch", b"not json\n[1]\n")[1]
    assert "no lines" in error(store.add, "a", "x", "batch", b"\n\n")[1]
    assert "UTF-8" in error(store.add, "a", "x", "batch", b"\xff\n")[1]
    nested = b"[" * 4000 + b"\n"  # past the parser's depth (under the cap): refused, not a crash
    assert "not JSONL" in error(store.add, "a", "x", "batch", nested)[1]
    mixed = store.add("a", "x", "batch", LINE + b"not json\n\n" + LINE)  # the batch reports it
    assert mixed.lines == 3
    store.delete("a", mixed.id)
    assert error(store.add, "a", "x", "batch", LINE * 60)[0] == 413  # over 4096 bytes
    for _ in range(2):
        store.add("a", "x", "batch", LINE * 30)  # 2 x 2,430 bytes
    assert error(store.add, "a", "x", "batch", LINE * 30)[0] == 429  # 7,290 > 6,000 bytes
    store.add("a", "x", "batch", LINE)
    assert error(store.add, "a", "x", "batch", LINE)[0] == 429  # a fourth file


def test_the_openai_clients_multipart_form_is_read():
    request = httpx.Request(
        "POST",
        "http://x/v1/files",
        files={"file": ("in.jsonl", LINE, "application/octet-stream")},
        data={"purpose": "batch"},
    )
    body = request.read()
    fields = form_fields(body, request.headers["content-type"])
    assert fields["file"] == ("in.jsonl", LINE) and fields["purpose"] == (None, b"batch")
    with pytest.raises(ApiError, match="multipart/form-data"):
        form_fields(b"{}", "application/json")
    with pytest.raises(ApiError, match="not a valid multipart body"):
        form_fields(b"--x\r\ngarbage", "multipart/form-data; boundary=y")
