"""The lean forward (services/models/fused.py) against transformers' forward, its plain twin.

Each fused C step against the torch calls it replaces (on strided views, as the packed products
hand them over); then small random-weight models of each architecture it serves through the
engine: the torch steps give transformers' logits bit for bit, the C steps the same greedy tokens
(with small prefill chunks and a pool small enough to preempt). A model with sliding windows
keeps transformers' forward. The real model's twins (constrained rows, every KV policy) are in
test_speed_twins.py.
"""

from __future__ import annotations

import pytest
import torch

from kvcache import attention, native
from kvcache.batch import SeqSlice, build_paged_batch
from services import LLM, SamplingParams
from services.models import fused
from tests.families import SMALL

ARCHITECTURES = {  # transformers config -> its arguments beyond SMALL (no windows)
    "LlamaConfig": {},
    "Qwen2Config": {"use_sliding_window": False},  # q/k/v biases
    "MistralConfig": {"sliding_window": None},
}
TOKEN_BYTES = 2 * 3 * 2 * 16 * 4  # K and V, SMALL's 3 layers of 2 KV heads of 16 float32


@pytest.fixture(scope="module")
def c_steps(tmp_path_factory) -> fused.CSteps:
    lib = native.library(fused.SOURCE, tmp_path_factory.mktemp("kernels"))
    if lib is None:
        pytest.skip("no C compiler: the torch steps serve")
    return fused.CSteps(lib)


class Norm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.variance_epsilon = 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_steps_equal_the_torch_steps(c_steps, dtype):
    """In bfloat16 the C steps round where the torch calls do (each op's result), so the
    residual stream is the same bits and the rest within a bfloat16 step."""
    torch.manual_seed(0)
    plain = fused.TorchSteps()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    rows, width, heads, dim = 7, 96, 3, 32
    norm = Norm(width).to(dtype)
    h = (torch.randn(rows, width) * 3).to(dtype)
    wide = torch.randn(rows, 2 * width).to(dtype)  # two siblings' product: rows are strided views
    for delta in (None, wide[:, width:]):
        want_h, want = plain.add_rms_norm(h.clone(), delta, norm)
        got_h, got = c_steps.add_rms_norm(h.clone(), delta, norm)
        torch.testing.assert_close(got_h, want_h, rtol=0, atol=0)
        torch.testing.assert_close(got, want, **tol)
    qkv = torch.randn(rows, 3 * heads * dim).to(dtype)
    angles = torch.rand(rows, dim // 2) * 10
    cos, sin = (f(torch.cat((angles, angles), dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    want = plain.rope(qkv[:, : heads * dim], cos, sin)
    got = c_steps.rope(qkv[:, : heads * dim], cos, sin)  # from a strided view, head-major
    assert got.shape == (heads, rows, dim) and got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    gate_up = (torch.randn(rows, 2 * width) * 4).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    want = plain.silu_mul(torch.nn.functional.silu, gate, up)
    torch.testing.assert_close(c_steps.silu_mul(None, gate, up), want, **tol)


def test_c_steps_refuse_what_they_cannot_read(c_steps):
    with pytest.raises(ValueError, match="float32"):
        c_steps.silu_mul(None, torch.randn(4, 8).t(), torch.randn(8, 4))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, loaded_model):
    import transformers
    from transformers import AutoModelForCausalLM

    tok = loaded_model.tokenizer
    out = {}
    for name, extra in ARCHITECTURES.items():
        folder = tmp_path_factory.mktemp(name)
        ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
        config = getattr(transformers, name)(vocab_size=len(tok), **SMALL, **ids, **extra)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        tok.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_torch_steps_give_transformers_logits_bit_for_bit(name, folders):
    runner = LLM(str(folders[name]), kv_cache_memory=4 << 20, grammar_workers=0).engine.runner
    assert runner.fused is not None
    lean = fused.FusedForward(runner.model, fused.TorchSteps())
    ids = torch.tensor([[5, 900, 17, 4000, 33, 1200, 8, 77, 301]])
    keep = torch.arange(ids.shape[1])
    logits = []
    for forward in (runner._transformers_forward, lean):
        batch, positions = build_paged_batch(runner.kv, [SeqSlice([0], 0, ids.shape[1])])
        with attention.stepping(batch), torch.inference_mode(), runner._products():
            logits.append(forward(ids, positions, keep))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_tokens_equal_the_plain_twin_with_preemption(name, folders, tokenizer):
    texts = [
        "The history of the Roman Empire spans many centuries and " * 4,
        "def fibonacci(n):\n    if n < 2:\n        return n\n" * 2,
        "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, " * 2,
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = {}
    for on in (True, False):
        # prefill chunks of 16 tokens and a pool of 12 pages for 3 requests of up to 6: preempted
        llm = LLM(
            str(folders[name]),
            max_num_batched_tokens=16,
            kv_cache_memory=12 * 16 * TOKEN_BYTES,
            grammar_workers=0,
            fused_forward=on,
        )
        assert (llm.engine.runner.fused is not None) == on
        outs[on] = [list(o.token_ids) for o in llm.generate(prompts, greedy)]
        assert llm.engine.scheduler.num_preemptions > 0
    assert outs[True] == outs[False]


def test_a_model_with_sliding_windows_keeps_the_transformers_forward(tmp_path, loaded_model):
    import transformers
    from transformers import AutoModelForCausalLM

    tok = loaded_model.tokenizer
    config = transformers.MistralConfig(vocab_size=len(tok), **SMALL, sliding_window=24)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert LLM(str(tmp_path), kv_cache_memory=4 << 20).engine.runner.fused is None


def test_a_lean_forward_that_fails_at_load_leaves_the_transformers_forward(folders, monkeypatch):
    def broken(self, *args):
        raise AttributeError("a module of another shape")

    monkeypatch.setattr(fused.FusedForward, "__call__", broken)
    llm = LLM(str(folders["LlamaConfig"]), kv_cache_memory=4 << 20, grammar_workers=0)
    assert llm.engine.runner.fused is None
    out = llm.generate(
        [[5, 900, 17]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
