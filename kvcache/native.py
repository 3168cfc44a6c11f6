"""The project's C code, built once per machine and loaded with ctypes: `library` for any of its
C files (`paged_attention.c` here, `hot_set.c` for the host tier's hot sets, the model's fused
steps in `services/models/fused_ops.c`), `load` for decode attention over the KV pages.

`library` builds a C file with the system C compiler (`CC`, else `cc`) into a folder the caller
names (the engine passes its cache folder), under a name that hashes the source, the flags and
the CPU's feature list (`-march=native` code must not run on another CPU sharing that folder).
A missing compiler, a failed build or a read-only folder leave it returning None: the caller
keeps its plain path (here: gather, then SDPA) and says so once in the log.

OpenMP: the library links `libgomp.so.1` by name, which resolves to the copy torch has already
loaded, so both share one thread pool instead of two pools spinning against each other.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
# included by the sources built here: a change to one rebuilds them all
HEADERS = tuple(Path(__file__).with_name(h) for h in ("simd_exp.h", "bf16.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class AttentionKernel(Protocol):
    """What `kvcache/attention.py` calls to read pages in place: `PagedKernel` (C, CPU) or
    `kvcache.triton_attention.TritonPagedKernel` (Triton, CUDA)."""

    prompt_chunks: bool  # prompt chunks over a cached prefix too (else: short queries only)
    quest: bool  # Quest rows' per-head page tables too

    def reads(self, dtype: torch.dtype, parked: bool) -> bool:
        """Whether it reads rows of this cache dtype (with pages parked in the host tier)."""
        ...

    def short(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        starts: torch.Tensor,
        num_queries: torch.Tensor,
        offsets: torch.Tensor,
        page_size: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        host: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_queries: int = 1,
        logical: torch.Tensor | None = None,
    ) -> None: ...


class PagedKernel:
    """`paged_attention_short` of the C file, over torch tensors (float32 or bfloat16, contiguous,
    CPU). `kvcache/triton_attention.py` has the same interface for CUDA."""

    prompt_chunks = False  # prompt chunks over a cached prefix keep the gather path
    quest = False  # so do Quest rows

    def reads(self, dtype: torch.dtype, parked: bool) -> bool:
        """Float32 and bfloat16 rows (bfloat16 widened to float32 as it is read, the sums in
        float32), parked pages included (the host tier's arena is CPU memory too)."""
        return dtype in (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_attention_short
        fn.restype = ctypes.c_int
        fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR]
        fn.argtypes += [_PTR, _I64]
        fn.argtypes += [_I64, _I64, _I64, _I64, ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int]
        fn.argtypes += [ctypes.c_int]  # bfloat16 tensors (else float32)
        self._fn = fn

    def short(
        self,
        q: torch.Tensor,  # [T, H, D] contiguous
        out: torch.Tensor,  # [T, H, D] contiguous: the rows' queries are written
        k_cache: torch.Tensor,  # [KVH, slots, D]
        v_cache: torch.Tensor,
        page_table: torch.Tensor,  # [R, max_pages] int64
        starts: torch.Tensor,  # [R] cache index of each row's first query
        num_queries: torch.Tensor,  # [R]
        offsets: torch.Tensor,  # [R] packed index of each row's first query
        page_size: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        host: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_queries: int = 1,  # what a GPU grid is sized by: the C loop reads num_queries
        logical: torch.Tensor | None = None,
    ) -> None:
        """`host`: the host tier's keys and values of this layer `[KVH, host_slots, D]`, where
        page ids from `k_cache`'s page count on are read (parked pages, in place)."""
        if logical is not None:
            raise ValueError("the C kernel reads no Quest tables (see `quest`)")
        if not q.dtype == out.dtype == k_cache.dtype == v_cache.dtype:
            raise ValueError("paged attention: q, out and the caches must share a dtype")
        rows, max_pages = page_table.shape
        kv_heads, slots, dim = k_cache.shape
        k_host, v_host = host if host is not None else (None, None)
        status = self._fn(
            q.data_ptr(),
            out.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots,
            k_host.data_ptr() if k_host is not None else None,
            v_host.data_ptr() if v_host is not None else None,
            k_host.shape[1] if k_host is not None else 0,
            page_table.data_ptr(),
            max_pages,
            starts.data_ptr(),
            num_queries.data_ptr(),
            offsets.data_ptr(),
            rows,
            q.shape[1],
            kv_heads,
            dim,
            page_size,
            scale,
            window or 0,
            softcap or 0.0,
            torch.get_num_threads(),
            int(k_cache.dtype == torch.bfloat16),
        )
        if status != 0:
            raise MemoryError("paged attention: no memory for a row's scores")


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, source: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, f"-I{HEADERS[0].parent}", str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, out)  # atomic: a concurrent builder sees a whole library or none
    finally:
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def library(source: Path, build_dir: Path) -> ctypes.CDLL | None:
    """`source` built into `build_dir` if it is not there yet, loaded; None where it cannot be
    (the reason logged once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("%s: no C compiler found; the plain path is kept", source.name)
        return None
    try:
        key = hashlib.sha256()
        sources = (source, *HEADERS)
        for part in (*(f.read_bytes() for f in sources), " ".join(FLAGS).encode()):
            key.update(part)
        key.update(_cpu_features().encode())
        path = build_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
        if not path.is_file():
            _build(compiler, source, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("%s unavailable (%s); the plain path is kept", source.name, detail)
        return None


def load(build_dir: Path) -> PagedKernel | None:
    """The kernel, built into `build_dir` if it is not there yet; None where it cannot be
    (attention then gathers pages)."""
    lib = library(SOURCE, build_dir)
    return PagedKernel(lib) if lib is not None else None
