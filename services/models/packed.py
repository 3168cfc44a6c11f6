"""Linear layers through oneDNN with their weights packed once, on CPU.

A decode step is a chain of small matrix products (a few rows against every weight of the model),
bound by how fast the weights stream from memory. `F.linear` on CPU goes to MKL's sgemm with the
weight as stored, which reads it well below the memory's bandwidth; oneDNN with the weight
reordered once into its blocked layout (what vLLM's CPU build and inductor's weight freezing do)
takes the same products faster from one row to a thousand (`benchmarks/vs_vllm.py` with
`--structserve-args '{"packed_weights": false}'` measures the twin), the LM head most of all.
Sibling layers fed the same input (q/k/v, gate/up) share one product, as vLLM's merged layers
do, which saves a little more of a step.

The model object stays usable by others (a transformers `generate` peer in a test or benchmark
shares it): each linear keeps its weight and answers with `F.linear` unless called inside
`packed_products()`, which the model runner enters around its own forward. The packed copies
cost one more copy of the linear weights in host memory.

A product of one or two rows (one request's decode step) goes instead to `small_products.c`,
which streams the weights as stored near the memory's rate where oneDNN reads them at about
half of it (`EngineConfig.small_products`; False: oneDNN for every size, the plain twin).

On CUDA nothing changes (cuBLAS reads weights as stored); `EngineConfig.packed_weights=False`
is the plain twin on CPU. Results differ from `F.linear` in the last bits (another summation
order), so the twins are compared on whole greedy outputs, not logits.
"""

from __future__ import annotations

import contextvars
import ctypes
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "structserve_packed_products", default=False
)
_SMALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "structserve_small_products", default=False
)
_DTYPES = (torch.float32, torch.bfloat16)
SMALL_ROWS = 2  # products of at most this many rows take small_products.c (its doc: measured)
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


class SmallProducts:
    """`small_products.c` through ctypes: y = x W^T + b for one or two rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.small_linear.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int]
        lib.small_linear_bf16.argtypes = [
            _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, ctypes.c_int
        ]  # fmt: skip
        self.lib = lib

    def into(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        y: torch.Tensor,
        scratch: torch.Tensor | None = None,
    ) -> None:
        """`x` [m, k] contiguous into `y` [m, n] (a column slice of a wider output is fine).
        bfloat16: `scratch`, m * k float32 the C side widens `x` into (one per group, not per
        member; made here when not given)."""
        m, k = x.shape
        n = weight.shape[0]
        b = bias.data_ptr() if bias is not None else None
        threads = torch.get_num_threads()
        if x.dtype == torch.bfloat16:
            if scratch is None:
                scratch = torch.empty(m * k, dtype=torch.float32)
            self.lib.small_linear_bf16(
                x.data_ptr(), weight.data_ptr(), b, y.data_ptr(), y.stride(0), m, n, k,
                scratch.data_ptr(), threads,
            )  # fmt: skip
        else:
            self.lib.small_linear(
                x.data_ptr(), weight.data_ptr(), b, y.data_ptr(), y.stride(0), m, n, k, threads
            )


def small_products(build_dir: Path) -> SmallProducts | None:
    """The one- and two-row products, built into `build_dir` on first use; None without a C
    compiler (oneDNN then takes every size)."""
    from kvcache import native

    lib = native.library(Path(__file__).with_name("small_products.c"), build_dir)
    return SmallProducts(lib) if lib is not None else None


@contextmanager
def packed_products(small: bool = False) -> Iterator[None]:
    """Linears packed by `pack_linears` use their packed weights inside this block, and with
    `small` their small products for one or two rows (where `pack_linears` was given them).
    Per block, not per model: engines sharing one model object each choose."""
    token, small_token = _ACTIVE.set(True), _SMALL.set(small)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _SMALL.reset(small_token)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in _DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _weight_key(w: torch.Tensor) -> tuple[int, torch.dtype, int]:
    """Which weights these are: storage, dtype, and in-place writes so far (-1 for an inference
    tensor, which counts none)."""
    try:
        version = w._version
    except RuntimeError:
        version = -1
    return w.data_ptr(), w.dtype, version


class _Product:
    """One packed product serving a group of sibling linears: layers fed the same input in one
    forward (a decoder's q/k/v projections, its gate and up projections), found by
    `sibling_inputs`. The first member called with an input computes every member's output in
    one product (one pass over the weights, one call instead of three); the others take their
    columns as long as they are called with that same input tensor."""

    def __init__(
        self,
        members: list[torch.nn.Linear],
        packed: torch.Tensor,
        small: SmallProducts | None = None,
    ) -> None:
        self.packed = packed
        self.small = small
        # the members' own weights, as stored (no copy): what the small products read
        self.weights = [m.weight.detach() for m in members]
        self.widths = [m.out_features for m in members]
        biases = [m.bias for m in members]
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b if b is not None else m.weight.new_zeros(m.out_features)
                    for b, m in zip(biases, members, strict=True)
                ]
            )
        )
        self.x: torch.Tensor | None = None  # the input whose outputs `outs` holds
        self.outs: tuple[torch.Tensor, ...] = ()
        self.left = 0  # members yet to take their output (then both are let go)

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self.x:
            flat = x.reshape(-1, x.shape[-1])
            if self.small is not None and 0 < flat.shape[0] <= SMALL_ROWS and _SMALL.get():
                y = self._small(flat.contiguous())
            else:
                y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            y = y.view(*x.shape[:-1], y.shape[-1])
            outs = y.split(self.widths, dim=-1) if len(self.widths) > 1 else (y,)
            self.x, self.outs, self.left = x, outs, len(self.widths)
        out = self.outs[member]
        self.left -= 1
        if self.left <= 0:
            self.x, self.outs = None, ()
        return out

    def _small(self, flat: torch.Tensor) -> torch.Tensor:
        """Every member's output for one or two rows, each read from its own weight."""
        assert self.small is not None
        y = flat.new_empty(flat.shape[0], sum(self.widths))
        scratch = None
        if flat.dtype == torch.bfloat16:
            scratch = torch.empty(flat.numel(), dtype=torch.float32)
        start = 0
        for weight, width in zip(self.weights, self.widths, strict=True):
            bias = self.bias[start : start + width] if self.bias is not None else None
            self.small.into(flat, weight, bias, y[:, start : start + width], scratch)
            start += width
        return y


def _packed_forward(
    linear: torch.nn.Linear, product: _Product, member: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    # the weight the copy was packed from: a model moved to another dtype or given new weights
    # afterwards (`to`, `load_state_dict`) computes plainly until it is packed again
    packed_from = _weight_key(linear.weight)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _ACTIVE.get() or _weight_key(linear.weight) != packed_from:
            return F.linear(x, linear.weight, linear.bias)
        return product.output(member, x)

    forward.packed_from = packed_from  # type: ignore[attr-defined]
    return forward


@contextmanager
def sibling_inputs(model: torch.nn.Module) -> Iterator[list[list[torch.nn.Linear]]]:
    """Records, over the forward run inside the block, the linears fed one same input tensor;
    the list it yields is filled when the block ends (groups of two or more, in call order)."""
    groups: dict[int, list[torch.nn.Linear]] = {}
    inputs: list[torch.Tensor] = []  # kept alive so no two inputs share an id

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        inputs.append(args[0])
        groups.setdefault(id(args[0]), []).append(module)  # type: ignore[arg-type]

    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    handles = [m.register_forward_pre_hook(record) for m in linears]
    found: list[list[torch.nn.Linear]] = []
    try:
        yield found
    finally:
        for h in handles:
            h.remove()
        found += [g for g in groups.values() if len(g) > 1 and len(set(map(id, g))) == len(g)]


def _pack(members: list[torch.nn.Linear], small: SmallProducts | None) -> bool:
    """Packs one group (or one linear); False when oneDNN cannot, or a product disagrees (the
    small one probed at one and two rows, oneDNN's at three)."""
    weight = torch.cat([m.weight.detach() for m in members])
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    if small is not None and not all(w.is_contiguous() for w in (m.weight for m in members)):
        small = None
    product = _Product(members, packed, small)
    with packed_products(small=True):
        for rows in (1, 2, 3):
            probe = torch.randn(rows, members[0].in_features, dtype=weight.dtype)
            for i, m in enumerate(members):
                want = F.linear(probe, m.weight, m.bias)
                if not torch.allclose(product.output(i, probe), want, rtol=1e-2, atol=1e-2):
                    return False
    for i, m in enumerate(members):
        m.forward = _packed_forward(m, product, i)  # type: ignore[method-assign,assignment]
    return True


def pack_linears(
    model: torch.nn.Module,
    siblings: list[list[torch.nn.Linear]] | None = None,
    small: SmallProducts | None = None,
) -> int:
    """Packs every `nn.Linear` of `model` (on CPU, float32 or bfloat16), each group of
    `siblings` into one product; returns how many linears are packed. `small`: the products of
    one or two rows go there (None: oneDNN takes every size).

    A layer whose packed product does not match `F.linear` on a probe keeps the plain path, and
    so does the whole model if oneDNN refuses (an unsupported dtype on this CPU, say)."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not linears or not available(linears[0].weight.device, linears[0].weight.dtype):
        return 0
    grouped = {id(m) for g in siblings or [] for m in g}
    units = list(siblings or []) + [[m] for m in linears if id(m) not in grouped]
    done = 0
    with torch.inference_mode():
        for members in units:
            keys = [getattr(vars(m).get("forward"), "packed_from", None) for m in members]
            if keys == [_weight_key(m.weight) for m in members]:
                done += len(members)  # packed already, from these weights (another engine)
                continue
            try:
                done += len(members) if _pack(members, small) else 0
            except RuntimeError as exc:
                log.warning("packed linear weights unavailable (%s): plain products", exc)
                return done
    return done
