"""`dtype="auto"` on a CPU: bfloat16 for a model stored in 16 bits where the CPU multiplies bf16
natively (as vLLM's CPU build takes it), float32 otherwise; a float32 model (the default SmolLM2
folder: the ground of every equality test) stays float32."""

from __future__ import annotations

import pytest
import torch

from services import LLM, SamplingParams
from services.engine import config as engine_config
from services.engine.config import EngineConfig
from services.models.loader import folder_dtype
from tests.families import SMALL

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory, loaded_model):
    import transformers
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("bf16-llama")
    tok = loaded_model.tokenizer
    config = transformers.LlamaConfig(vocab_size=len(tok), **SMALL)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_the_choice_follows_the_stored_dtype_and_the_cpu(monkeypatch):
    auto, fp32 = EngineConfig(), EngineConfig(dtype="float32")
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: True)
    assert auto.torch_dtype(CPU, torch.bfloat16) == torch.bfloat16
    assert auto.torch_dtype(CPU, torch.float16) == torch.bfloat16
    assert auto.torch_dtype(CPU, torch.float32) == torch.float32
    assert auto.torch_dtype(CPU, None) == torch.float32
    assert fp32.torch_dtype(CPU, torch.bfloat16) == torch.float32  # the plain twin, by name
    assert auto.torch_dtype(torch.device("cuda"), torch.float32) == torch.bfloat16
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: False)
    assert auto.torch_dtype(CPU, torch.bfloat16) == torch.float32  # emulated bf16 is slower


def test_the_default_model_stays_float32(loaded_model):
    assert folder_dtype(None) == torch.float32
    assert EngineConfig().torch_dtype(CPU, folder_dtype(None)) == torch.float32


def test_an_engine_runs_a_bf16_model_in_bf16_where_the_cpu_has_it(bf16_folder, monkeypatch):
    assert folder_dtype(bf16_folder) == torch.bfloat16
    want = torch.bfloat16 if engine_config.cpu_has_native_bf16() else torch.float32
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    auto = LLM(str(bf16_folder), kv_cache_memory=4 << 20, grammar_workers=0)
    assert auto.engine.runner.dtype == want
    assert next(auto.engine.runner.model.parameters()).dtype == want
    assert auto.engine.runner.kv.layout.dtype == want
    assert len(auto.generate([[5, 900, 17]], greedy)[0].token_ids) == 4
    plain = LLM(str(bf16_folder), kv_cache_memory=4 << 20, grammar_workers=0, dtype="float32")
    assert plain.engine.runner.dtype == torch.float32
