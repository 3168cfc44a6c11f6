"""Tenants' files (OpenAI's Files API): a record in Redis, the bytes in a blob store.

Each tenant's records are its own Redis hash (`structserve:tenant:<tenant>:files`, id -> record),
so another tenant's id is simply absent: "not found" is the only answer it can get. The bytes
live in a blob store the operator configures: a local directory by default, or a bucket (any
fsspec URL, `s3://bucket/prefix` with the `s3` extra) through the same three calls. A file
meant for a batch is checked as it is kept: UTF-8 JSONL (a line that is not JSON is left to the
batch, which reports it in its error file); caps on a file's bytes and a tenant's files and bytes.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from grammar_registry.registrations import DictHashes, hash_call

PURPOSES = ("batch",)  # what a tenant may upload; the service writes batch_output files itself


class FileError(ValueError):
    """A 4xx: `status` and the `field` it names."""

    def __init__(self, message: str, status: int = 400, field: str | None = "file") -> None:
        super().__init__(message)
        self.status, self.field = status, field


class FileCaps(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_file_bytes: int = Field(default=100 << 20, ge=1)
    max_files: int = Field(default=500, ge=0)  # a tenant's, output files included
    max_bytes: int = Field(default=10 << 30, ge=0)  # a tenant's, summed


class FileRecord(BaseModel):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    lines: int = 0

    def view(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


class Blobs(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def delete(self, key: str) -> None: ...


class LocalBlobs:
    """Blobs as files under `root` (keys are made here: tenant names and random ids only)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        partial.replace(path)  # whole or absent, never half-written

    def get(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)


class RemoteBlobs:
    """Blobs in a bucket (any fsspec URL). A bucket that does not answer is a 503 (the client
    may try again), never a 500; a missing object stays FileNotFoundError."""

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url, **(options or {}))
        self.root = root.rstrip("/")

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError:
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"[:200]
            raise FileError(f"the file store is unavailable ({reason})", 503, None) from exc

    def put(self, key: str, data: bytes) -> None:
        with self._answering():
            self.fs.pipe_file(f"{self.root}/{key}", data)

    def get(self, key: str) -> bytes:
        with self._answering():
            data: bytes = self.fs.cat_file(f"{self.root}/{key}")
        return data

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError), self._answering():
            self.fs.rm_file(f"{self.root}/{key}")


def open_blobs(url: str, options: dict[str, Any] | None = None) -> Blobs:
    if "://" not in url or url.startswith("file://"):
        return LocalBlobs(url.removeprefix("file://"))
    return RemoteBlobs(url, options)


def jsonl_lines(data: bytes) -> int:
    """The number of lines of a batch file (blank lines aside); FileError when it is not JSONL
    at all (not UTF-8 text, or not one line a JSON object). A line that is not JSON is the
    batch's to report, in its error file, as OpenAI's batches do."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileError(f"file: not UTF-8 (byte {exc.start})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise FileError("file: no lines")
    if not any(_is_object(line) for line in lines[:1000]):
        raise FileError("file: not JSONL (no line among the first is a JSON object)")
    return len(lines)


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):  # nested past the parser's depth: not a line we read
        return False


class FileStore:
    def __init__(self, client: Any | None, blobs: Blobs, caps: FileCaps | None = None) -> None:
        self.client = client if client is not None else DictHashes()
        self.blobs = blobs
        self.caps = caps or FileCaps()
        self._lock = threading.Lock()  # caps are checked and written under one lock per process

    @staticmethod
    def _key(tenant: str) -> str:
        return f"structserve:tenant:{tenant}:files"

    def _call(self, method: str, *args: Any) -> Any:
        return hash_call(self.client, "files", method, *args)

    def add(
        self, tenant: str, filename: str, purpose: str, data: bytes, service: bool = False
    ) -> FileRecord:
        """Checks and keeps a tenant's upload; `service`: a batch's output, written by the
        service, which no cap refuses (a batch's results are never dropped; they count
        towards the tenant's caps for its next uploads)."""
        if len(data) > self.caps.max_file_bytes and not service:
            cap = self.caps.max_file_bytes
            raise FileError(f"file: {len(data)} bytes, over the {cap}-byte limit", 413)
        lines = jsonl_lines(data) if purpose == "batch" else data.count(b"\n")
        record = FileRecord(
            id="file-" + secrets.token_hex(12),
            bytes=len(data),
            created_at=int(time.time()),
            filename=filename[:255] or "upload.jsonl",
            purpose=purpose,
            lines=lines,
        )
        with self._lock:
            kept = [] if service else self.list(tenant)
            if len(kept) >= self.caps.max_files and not service:
                raise FileError(f"files: the tenant's cap of {self.caps.max_files} files", 429)
            used = sum(r.bytes for r in kept)
            if used + len(data) > self.caps.max_bytes:
                cap = self.caps.max_bytes
                raise FileError(f"files: {used + len(data)} bytes would exceed {cap}", 429)
            self.blobs.put(f"{tenant}/{record.id}", data)  # the bytes first: a record has them
            self._call("hset", self._key(tenant), record.id, record.model_dump_json())
        return record

    def get(self, tenant: str, file_id: str) -> FileRecord:
        raw = self._call("hget", self._key(tenant), file_id)
        if raw is None:
            raise FileError(f"file {file_id[:100]!r} not found", 404, "file_id")
        return FileRecord.model_validate_json(raw)

    def content(self, tenant: str, file_id: str) -> bytes:
        record = self.get(tenant, file_id)
        try:
            return self.blobs.get(f"{tenant}/{record.id}")
        except FileNotFoundError as exc:
            raise FileError(f"file {file_id!r}: its content is gone", 404, "file_id") from exc

    def list(self, tenant: str, purpose: str | None = None) -> list[FileRecord]:
        """Newest first, as OpenAI lists them."""
        rows = self._call("hgetall", self._key(tenant))
        records = [FileRecord.model_validate(json.loads(v)) for v in rows.values()]
        records = [r for r in records if purpose is None or r.purpose == purpose]
        return sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)

    def delete(self, tenant: str, file_id: str) -> None:
        record = self.get(tenant, file_id)
        self._call("hdel", self._key(tenant), record.id)
        self.blobs.delete(f"{tenant}/{record.id}")
