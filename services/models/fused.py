"""A lean forward for Llama-family decoder models, with their elementwise steps fused on CPU.

transformers' forward spends, per layer, some forty torch calls on a decode step: two RMSNorms of
six calls each, RoPE's fourteen, SiLU and the product, two residual adds, plus its own module and
keyword plumbing. At decode sizes each call costs more in dispatch than in arithmetic: a small
model's one-token step spends a large share of its time outside the matrix products.
This forward walks the same modules (their weights, the packed linears, the rotary embedding,
the paged attention function) with each step in one call: `fused_ops.c` on CPU in float32 or
bfloat16 (residual add and norm in one pass, RoPE, SiLU times up), the same torch calls as
transformers elsewhere (CUDA, float16, no C compiler), which keeps only the lighter walk.

It serves the architectures whose decoder layer is Llama's (`ARCHITECTURES`) and only where
every layer's attention is plain (no sliding window, no soft cap); anything else keeps
transformers' forward. At load a few tokens go through both forwards and must agree
(`ModelRunner._agrees`), or the plain one is kept. `EngineConfig.fused_forward=False` is the
plain twin; the fused steps round differently in the last bits (another summation order,
another exp), so the twins are compared on whole greedy outputs.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

from kvcache import attention, native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_ops.c")
# transformers classes whose decoder layer is Llama's: norm, q/k/v (biases or not), RoPE,
# attention, o, residual; norm, gate/up, SiLU, down, residual
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


class TorchSteps:
    """Each step as transformers' Llama computes it (the same calls in the same order)."""

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)); delta None: no residual add."""
        if delta is not None:
            h = h + delta
        x = h.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + norm.variance_epsilon)
        return h, norm.weight * x.to(h.dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[T, heads * D]`, cos and sin `[T, D]`: the rotated heads, head-major `[heads, T, D]`
        (the layout transformers hands attention, which prompt chunks read fastest)."""
        x = x.view(x.shape[0], -1, cos.shape[-1]).transpose(0, 1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def silu_mul(self, act: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(gate) * up


C_DTYPES = (torch.float32, torch.bfloat16)  # what fused_ops.c has steps for


class CSteps(TorchSteps):
    """The steps through `fused_ops.c` (CPU, float32 or bfloat16): one call and one pass each.
    Every tensor of a step shares the model's dtype (cos and sin are cast to it, as
    transformers' rotary embedding returns them)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for suffix in ("", "_bf16"):  # float32, bfloat16
            getattr(lib, "rms_norm" + suffix).argtypes = [
                _PTR, _I64, _PTR, _F32, _PTR, _I64, _I64, _I64, _INT
            ]  # fmt: skip
            getattr(lib, "add_rms_norm" + suffix).argtypes = [
                _PTR, _PTR, _I64, _PTR, _F32, _PTR, _I64, _I64, _INT
            ]  # fmt: skip
            getattr(lib, "silu_mul" + suffix).argtypes = [
                _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _INT
            ]  # fmt: skip
            getattr(lib, "rope" + suffix).argtypes = [
                _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT
            ]  # fmt: skip
        self.lib = lib

    def _fn(self, name: str, t: torch.Tensor) -> Any:
        """The C step `name` for `t`'s dtype."""
        return getattr(self.lib, name + ("_bf16" if t.dtype == torch.bfloat16 else ""))

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not h.is_contiguous():  # the C steps write it row after row
            raise ValueError("fused step: the residual stream must be contiguous")
        rows, width = h.shape
        out = torch.empty_like(h)
        eps, threads = norm.variance_epsilon, torch.get_num_threads()
        if delta is None:
            self._fn("rms_norm", h)(
                h.data_ptr(), width, norm.weight.data_ptr(), eps, out.data_ptr(), width,
                rows, width, threads,
            )  # fmt: skip
        else:  # h is this forward's own residual stream: updated in place
            _check_rows(delta)
            self._fn("add_rms_norm", h)(
                h.data_ptr(), delta.data_ptr(), delta.stride(0), norm.weight.data_ptr(), eps,
                out.data_ptr(), rows, width, threads,
            )  # fmt: skip
        return h, out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        _check_rows(x)
        rows, dim = x.shape[0], cos.shape[-1]
        out = x.new_empty(x.shape[1] // dim, rows, dim)
        self._fn("rope", x)(
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows,
            out.shape[0], dim, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, act: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check_rows(gate)
        _check_rows(up)
        rows, width = gate.shape
        out = gate.new_empty(rows, width)
        self._fn("silu_mul", gate)(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
            rows, width, torch.get_num_threads(),
        )  # fmt: skip
        return out


def _check_rows(t: torch.Tensor) -> None:
    if t.dim() != 2 or t.stride(1) != 1 or t.dtype not in C_DTYPES:
        raise ValueError(f"fused step: rows of {C_DTYPES} expected, got {t.dtype} {t.stride()}")


class FusedForward:
    """`model(input_ids, position_ids, logits_to_keep=keep).logits[0]`, computed leanly."""

    def __init__(self, model: torch.nn.Module, steps: TorchSteps) -> None:
        self.steps = steps
        self.inner: Any = model.model
        self.lm_head: Any = model.lm_head

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """input_ids and position_ids `[1, T]`; logits `[len(keep), vocab]` of the rows kept."""
        inner, steps = self.inner, self.steps
        attend = attention.paged_attention_forward  # looked up per call: a profiler may wrap it
        h = inner.embed_tokens(input_ids)[0]  # [T, C]
        cos, sin = (t[0].contiguous() for t in inner.rotary_emb(h[None], position_ids))
        layers = inner.layers
        h, x = steps.add_rms_norm(h, None, layers[0].input_layernorm)
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            q = steps.rope(a.q_proj(x), cos, sin)  # [H, T, D]
            k = steps.rope(a.k_proj(x), cos, sin)
            v = a.v_proj(x).view(x.shape[0], -1, a.head_dim).transpose(0, 1)
            o, _ = attend(a, q[None], k[None], v[None], None, dropout=0.0, scaling=a.scaling)
            h, x = steps.add_rms_norm(h, a.o_proj(o[0].flatten(1)), layer.post_attention_layernorm)
            down = mlp.down_proj(steps.silu_mul(mlp.act_fn, mlp.gate_proj(x), mlp.up_proj(x)))
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else inner.norm
            h, x = steps.add_rms_norm(h, down, after)
        return self.lm_head(x[keep])


def unsupported(model: torch.nn.Module, plain_attention: bool) -> str | None:
    """Why this model keeps transformers' forward; None where the lean one serves it."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {', '.join(ARCHITECTURES)}"
    if not plain_attention:
        return "its attention has per-layer variants"
    config: Any = model.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r}"
    return None


def for_model(
    model: torch.nn.Module, plain_attention: bool, build_dir: Path
) -> FusedForward | None:
    """The lean forward for `model`, or None (the reason logged) where transformers' stays."""
    reason = unsupported(model, plain_attention)
    if reason is not None:
        log.info("fused forward: not for this model (%s); transformers' forward runs", reason)
        return None
    weight = model.get_parameter("lm_head.weight")
    steps = TorchSteps()
    if weight.device.type == "cpu" and weight.dtype in C_DTYPES:
        lib = native.library(SOURCE, build_dir)
        if lib is not None:
            steps = CSteps(lib)
    return FusedForward(model, steps)
