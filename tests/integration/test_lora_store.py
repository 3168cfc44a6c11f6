"""The adapter store on a bucket: moto's S3 server (a real S3 endpoint, over HTTP) through s3fs,
as an operator would point `adapters.store` at one. An adapter is copied into the local cache by
its objects' versions and checked there like a local folder; sizes are read before any copy;
`..` never leaves the prefix; a store that does not answer is a 503, not a 400."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from services.lora.adapter import AdapterError, BaseShape, Limits, inspect_adapter
from services.lora.store import LocalStore, RemoteStore, StoreUnavailable, open_store
from tests.lora_adapters import write_peft

CONFIG = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128,
)  # fmt: skip
LIMITS = Limits(max_rank=16, max_bytes=1 << 20)


def upload(client, folder, prefix):
    for f in folder.iterdir():
        client.upload_file(str(f), "adapters", f"{prefix}/{f.name}")


def store(url, cache, max_bytes=LIMITS.max_bytes):
    options = {"endpoint_url": url, "key": "k", "secret": "s"}
    return open_store("s3://adapters/tenants", cache, max_bytes, options)


def test_a_bucket_adapter_is_copied_by_version_and_checked_like_a_folder(s3, tmp_path):
    url, client = s3
    upload(client, write_peft(tmp_path / "src", CONFIG, 4, ("q_proj",)), "tenants/acme/v1")
    remote = store(url, tmp_path / "cache")
    assert isinstance(remote, RemoteStore)
    first = remote.folder("acme/v1")
    assert first == remote.folder("acme/v1")  # copied once
    assert inspect_adapter(first, BaseShape.of(CONFIG), LIMITS).rank == 4
    upload(client, write_peft(tmp_path / "new", CONFIG, 8, ("v_proj",), seed=3), "tenants/acme/v1")
    second = remote.folder("acme/v1")  # new objects under the same name: another folder
    assert second != first and inspect_adapter(second, BaseShape.of(CONFIG), LIMITS).rank == 8


def test_bad_sources_and_sizes_are_refused_before_a_copy(s3, tmp_path):
    url, client = s3
    folder = write_peft(tmp_path / "src", CONFIG, 4, ("q_proj",))
    upload(client, folder, "tenants/big")
    size = (folder / "adapter_model.safetensors").stat().st_size
    remote = store(url, tmp_path / "cache", max_bytes=size - 1)
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: .*over the"):
        remote.folder("big")
    assert not any((tmp_path / "cache").iterdir())  # nothing was copied
    for source, match in (("nothing", "missing"), ("../x", "source"), ("a/../../b", "source")):
        with pytest.raises(AdapterError, match=match):
            remote.folder(source)


def test_a_store_that_does_not_answer_is_unavailable_not_bad(tmp_path):
    dead = store("http://127.0.0.1:9", tmp_path / "cache")
    with pytest.raises(StoreUnavailable):
        dead.folder("acme/v1")


def test_a_directory_is_a_local_store(tmp_path):
    assert isinstance(open_store(str(tmp_path), None, 1), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}", None, 1), LocalStore)
