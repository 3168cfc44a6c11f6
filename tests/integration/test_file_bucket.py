"""The Batch API's files on a bucket (moto's S3 server through s3fs, `files.store` an s3 URL)
with their records in a real Redis: bytes round-trip, a deleted object is a 404, a bucket that
does not answer is a 503 (try again), never a 500."""

from __future__ import annotations

import os

import pytest
import redis

from services.batches.files import FileError, FileStore, RemoteBlobs, open_blobs

LINE = b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def client():
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0] + "/13"
    r = redis.Redis.from_url(url)
    try:
        r.ping()
    except redis.ConnectionError:
        pytest.skip("needs Redis (make redis)")
    r.flushdb()
    yield r
    r.flushdb()


def bucket(endpoint: str) -> RemoteBlobs:
    blobs = open_blobs("s3://batches/files", {"endpoint_url": endpoint, "key": "k", "secret": "s"})
    assert isinstance(blobs, RemoteBlobs)
    return blobs


def test_files_on_a_bucket_round_trip_and_stay_their_tenants(s3, client):
    endpoint, s3_client = s3
    store = FileStore(client, bucket(endpoint))
    record = store.add("acme", "in.jsonl", "batch", LINE * 2)
    assert store.content("acme", record.id) == LINE * 2
    listed = s3_client.list_objects_v2(Bucket="batches", Prefix="files/acme/")["Contents"]
    assert [x["Key"] for x in listed] == [f"files/acme/{record.id}"]
    with pytest.raises(FileError) as err:
        store.content("beta", record.id)
    assert err.value.status == 404
    s3_client.delete_object(Bucket="batches", Key=f"files/acme/{record.id}")
    with pytest.raises(FileError, match="content is gone") as err:
        store.content("acme", record.id)
    assert err.value.status == 404
    store.delete("acme", record.id)  # the object already gone: the record still goes
    assert store.list("acme") == []


def test_a_bucket_that_does_not_answer_is_a_503_not_a_500(client):
    store = FileStore(client, bucket("http://127.0.0.1:9"))
    with pytest.raises(FileError) as err:
        store.add("acme", "in.jsonl", "batch", LINE)
    assert err.value.status == 503 and "unavailable" in str(err.value)
    assert store.list("acme") == []  # no record without its bytes
