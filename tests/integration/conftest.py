"""A real S3 endpoint for the stores that take a bucket (adapters, files): moto's server over
HTTP, reached through s3fs as an operator's bucket would be."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def s3():
    """`(endpoint URL, boto3 client)`, with the buckets `adapters` and `batches`."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    client = boto3.client(
        "s3", endpoint_url=url, aws_access_key_id="k", aws_secret_access_key="s",
        region_name="us-east-1",
    )  # fmt: skip
    for bucket in ("adapters", "batches"):
        client.create_bucket(Bucket=bucket)
    yield url, client
    server.stop()
