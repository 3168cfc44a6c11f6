"""The operator's adapter store: where the folders a tenant may name live.

A tenant names an adapter by `source`, a path relative to the store, and reaches nothing outside
it. `LocalStore` is a directory (a PVC in the chart). `RemoteStore` is a bucket, or any fsspec
URL (`s3://bucket/prefix` with s3fs, the `s3` extra): an adapter's two files are copied into a
local cache folder named by the objects' ETags before anything checks them, their sizes read
first (a 10 GB object costs a HEAD request, and a copy stops at the cap whatever the listing
said). Both hand `inspect_adapter` (adapter.py) a local folder, the same checks for both.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Protocol

from services.lora.adapter import (
    CONFIG,
    MAX_CONFIG_BYTES,
    WEIGHTS,
    AdapterError,
    resolve,
    source_parts,
)

COPY_CHUNK = 1 << 20


class StoreUnavailable(RuntimeError):
    """The store did not answer (a 503: worth a retry), unlike `AdapterError` (a 400)."""

    status = 503


class AdapterStore(Protocol):
    def folder(self, source: str) -> Path:
        """The local folder holding `source`'s files; `AdapterError` when there is none."""
        ...


class LocalStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def folder(self, source: str) -> Path:
        return resolve(self.root, source)


class RemoteStore:
    def __init__(
        self, url: str, cache: str | Path, max_bytes: int, options: dict[str, Any] | None = None
    ) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url, **(options or {}))
        self.root = root.rstrip("/")
        self.cache = Path(cache)
        self.cache.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # one copy of a folder at a time in this process

    def folder(self, source: str) -> Path:
        remote = "/".join((self.root, *source_parts(source)))
        caps = {CONFIG: MAX_CONFIG_BYTES, WEIGHTS: self.max_bytes}
        tags = [remote] + [self._tag(f"{remote}/{name}", name, cap) for name, cap in caps.items()]
        local = self.cache / hashlib.sha256("\n".join(tags).encode()).hexdigest()[:32]
        with self._lock:
            if not local.is_dir():
                self._copy(remote, caps, local)
        return local

    def _tag(self, path: str, name: str, cap: int) -> str:
        """The object's size and version (ETag or change time), after its size is checked."""
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            raise AdapterError(name, "missing in the adapter store") from None
        except Exception as exc:
            raise StoreUnavailable(f"the adapter store: {type(exc).__name__}") from exc
        size = int(info.get("size") or 0)
        if info.get("type") != "file":
            raise AdapterError(name, "missing in the adapter store (not a file)")
        if size > cap:
            raise AdapterError(name, f"{size} bytes, over the {cap}-byte limit")
        version = info.get("ETag") or info.get("etag") or info.get("mtime") or ""
        return f"{size}:{version}"

    def _copy(self, remote: str, caps: dict[str, int], local: Path) -> None:
        """Both files into a private folder, renamed into place when whole (another process
        copying the same adapter renames first or finds it there)."""
        partial = Path(tempfile.mkdtemp(dir=self.cache, prefix=".partial-"))
        try:
            for name, cap in caps.items():
                self._bounded_copy(f"{remote}/{name}", partial / name, name, cap)
            try:
                os.rename(partial, local)
            except OSError:  # another process put it there first
                if not local.is_dir():
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def _bounded_copy(self, path: str, to: Path, name: str, cap: int) -> None:
        copied = 0
        try:
            with self.fs.open(path, "rb") as src, to.open("wb") as dst:
                while chunk := src.read(COPY_CHUNK):
                    copied += len(chunk)
                    if copied > cap:  # replaced by a bigger object since its size was read
                        raise AdapterError(name, f"over the {cap}-byte limit")
                    dst.write(chunk)
        except AdapterError:
            raise
        except FileNotFoundError:
            raise AdapterError(name, "missing in the adapter store") from None
        except Exception as exc:
            raise StoreUnavailable(f"the adapter store: {type(exc).__name__}") from exc


def open_store(
    url: str, cache: str | Path | None, max_bytes: int, options: dict[str, Any] | None = None
) -> AdapterStore:
    """A `LocalStore` for a directory (or `file://`), a `RemoteStore` for any other URL."""
    if "://" not in url or url.startswith("file://"):
        return LocalStore(url.removeprefix("file://"))
    cache = cache or Path(tempfile.gettempdir()) / "structserve-adapters"
    return RemoteStore(url, cache, max_bytes, options)
