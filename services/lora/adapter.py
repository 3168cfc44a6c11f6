"""A LoRA adapter checked before anything loads it: a PEFT folder a tenant names is hostile input.

`inspect_adapter` reads a folder (`adapter_config.json` + `adapter_model.safetensors`) under the
operator's adapter store and either returns what the engine needs (rank, scale, the target
modules, the tensors by layer) or raises `AdapterError` naming what is wrong: a path out of the
store (`..`, a symlink), a missing or oversized file, a rank above `max_rank`, a target module
the model lacks, a tensor whose shape does not fit the base model, NaN or Inf weights. Sizes are
checked on the file system before a byte is read, and only the safetensors header is parsed
before the shapes are known to fit, so a 10 GB file or a lying header costs a `stat`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 64 << 10
# the projections an adapter may target, by their Hugging Face names (Llama, Qwen, Mistral, ...)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(" + "|".join(TARGETS) + r")\.lora_([AB])(?:\.default)?\.weight$"
)


class AdapterError(ValueError):
    """A 400: `field` names the part of the adapter that is wrong."""

    status = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class BaseShape:
    """What an adapter must fit: the base model's layer count and each projection's in/out."""

    layers: int
    dims: dict[str, tuple[int, int]]  # module -> (in_features, out_features)

    @classmethod
    def of(cls, config: Any) -> BaseShape:
        """From a transformers config (or anything with the same attribute names)."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        inter = config.intermediate_size
        dims = {
            "q_proj": (hidden, heads * head_dim),
            "k_proj": (hidden, kv * head_dim),
            "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(config.num_hidden_layers, dims)


@dataclass(frozen=True)
class Limits:
    max_rank: int = 64
    max_bytes: int = 256 << 20  # the weights file


@dataclass
class Adapter:
    """A checked adapter: `weights[(layer, module)] = (A [r, in], B [out, r])`, scale alpha/r."""

    rank: int
    scale: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def source_parts(source: str) -> tuple[str, ...]:
    """`source`'s path parts: relative, no `..`, nothing a file system would read otherwise."""
    if not source or source.startswith("/") or "\\" in source or "\x00" in source:
        raise AdapterError("source", "a relative path inside the adapter store")
    parts = Path(source).parts
    if ".." in parts or ":" in source:
        raise AdapterError("source", "'..' or ':' leaves the adapter store")
    return parts


def resolve(store: Path, source: str) -> Path:
    """The folder `source` names inside `store`: relative, no `..`, no symlink on the way."""
    parts = source_parts(source)
    root = store.resolve()
    here = root
    for part in parts:  # each step checked: a symlink anywhere could point out of the store
        here = here / part
        if here.is_symlink():
            raise AdapterError("source", "a symlink in the path")
    if not here.is_dir():
        raise AdapterError("source", "no such adapter folder in the store")
    return here


@dataclass(frozen=True)
class Checked:
    """An adapter whose config, sizes and tensor shapes passed (`check_adapter`); its weights
    are read by `read_weights`, the slow half (off the engine's step: manager.py)."""

    folder: Path
    rank: int
    scale: float
    targets: tuple[str, ...]
    pairs: dict[tuple[int, str], dict[str, str]]

    def read(self) -> Adapter:
        """The adapter's weights, each checked finite (`AdapterError` when not)."""
        weights = _load(self.folder / WEIGHTS, self.pairs)
        return Adapter(self.rank, self.scale, self.targets, weights)


def check_adapter(folder: Path, base: BaseShape, limits: Limits) -> Checked:
    """Everything but the weights' values: the config, the files' sizes by `stat`, the
    safetensors header and every shape against the base model. Cheap whatever the file."""
    config = _config(folder)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError("adapter_config.r", "a positive integer")
    if rank > limits.max_rank:
        raise AdapterError("adapter_config.r", f"{rank} is above max_lora_rank {limits.max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError("adapter_config.lora_alpha", "a finite number")
    targets = _targets(config.get("target_modules"))
    if config.get("use_dora") or config.get("use_rslora"):
        raise AdapterError("adapter_config", "DoRA and rsLoRA adapters are not served")
    headers = _header(folder / WEIGHTS, limits)
    pairs = _pairs(headers, base, rank, set(targets))
    return Checked(folder, rank, float(alpha) / rank, targets, pairs)


def inspect_adapter(folder: Path, base: BaseShape, limits: Limits) -> Adapter:
    """The checked adapter in `folder` (see the module's docstring), or `AdapterError`."""
    return check_adapter(folder, base, limits).read()


def _regular_file(path: Path, name: str, cap: int) -> int:
    if path.is_symlink() or not path.is_file():
        raise AdapterError(name, "missing (a regular file, not a link)")
    size = path.stat().st_size
    if size > cap:
        raise AdapterError(name, f"{size} bytes, over the {cap}-byte limit")
    return size


def _config(folder: Path) -> dict[str, Any]:
    _regular_file(folder / CONFIG, CONFIG, MAX_CONFIG_BYTES)
    try:
        config = json.loads((folder / CONFIG).read_text("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(CONFIG, f"not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(CONFIG, "a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError("adapter_config.peft_type", "only LORA adapters are served")
    return config


def _targets(raw: Any) -> tuple[str, ...]:
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise AdapterError("adapter_config.target_modules", "a list of module names")
    wrong = sorted(set(names) - set(TARGETS))
    if wrong:
        raise AdapterError(
            "adapter_config.target_modules",
            f"{wrong[:4]} not in this model's projections {list(TARGETS)}",
        )
    return tuple(n for n in TARGETS if n in names)


def _header(path: Path, limits: Limits) -> dict[str, Any]:
    """The safetensors header alone (8-byte length, then JSON), after the file's size."""
    size = _regular_file(path, WEIGHTS, limits.max_bytes)
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterError(WEIGHTS, "not a safetensors file")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, 16 << 20):
            raise AdapterError(WEIGHTS, "its header is longer than the file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise AdapterError(WEIGHTS, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise AdapterError(WEIGHTS, "its header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _pairs(
    header: dict[str, Any], base: BaseShape, rank: int, targets: set[str]
) -> dict[tuple[int, str], dict[str, str]]:
    """Each (layer, module)'s A and B tensor names, every shape checked against the base."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name, meta in header.items():
        m = _KEY.match(name)
        if m is None:
            raise AdapterError(WEIGHTS, f"tensor {name[:120]!r} is not a LoRA weight of this model")
        layer, module, which = int(m[1]), m[2], m[3]
        if layer >= base.layers:
            raise AdapterError(WEIGHTS, f"{name[:120]}: the model has {base.layers} layers")
        if module not in targets:
            raise AdapterError(WEIGHTS, f"{name[:120]}: {module} is not in target_modules")
        if not isinstance(meta, dict) or meta.get("dtype") not in ("F32", "F16", "BF16"):
            raise AdapterError(WEIGHTS, f"{name[:120]}: weights in F32, F16 or BF16")
        d_in, d_out = base.dims[module]
        want = [rank, d_in] if which == "A" else [d_out, rank]
        if meta.get("shape") != want:
            raise AdapterError(
                WEIGHTS, f"{name[:120]}: shape {meta.get('shape')}, this model needs {want}"
            )
        pairs.setdefault((layer, module), {})[which] = name
    if not pairs:
        raise AdapterError(WEIGHTS, "no LoRA weights")
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(WEIGHTS, f"layer {layer} {module}: lora_A and lora_B go together")
    return pairs


def _load(path: Path, pairs: dict[tuple[int, str], dict[str, str]]) -> dict:
    import torch
    from safetensors import SafetensorError, safe_open

    weights = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key, ab in pairs.items():
                a, b = f.get_tensor(ab["A"]).float(), f.get_tensor(ab["B"]).float()
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    raise AdapterError(WEIGHTS, f"layer {key[0]} {key[1]}: NaN or Inf weights")
                weights[key] = (a, b)
    except SafetensorError as exc:
        raise AdapterError(WEIGHTS, f"unreadable ({str(exc)[:200]})") from None
    return weights
