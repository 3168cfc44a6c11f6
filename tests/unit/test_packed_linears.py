"""Linear layers with packed weights (services/models/packed.py) on a small random Llama: the same
products inside the engine's block, untouched behaviour outside it (a peer sharing the model), and
a plain fallback when the weights change under them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from services.models import packed


def small_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_packed_products_match_and_stay_inside_their_block():
    model = small_llama()
    ids = torch.randint(0, 300, (1, 9))
    plain = logits(model, ids)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert packed.pack_linears(model) == linears
    assert packed.pack_linears(model) == linears  # a second engine on the model packs nothing new
    assert torch.equal(logits(model, ids), plain)  # outside the block: F.linear, bit for bit
    with packed.packed_products():
        inside = logits(model, ids)
    torch.testing.assert_close(inside, plain, rtol=1e-4, atol=1e-4)
    # the block really reads the packed copies: a write through `.data` (which no version
    # counter sees) changes the plain products only
    model.lm_head.weight.data.zero_()
    with packed.packed_products():
        assert torch.equal(logits(model, ids), inside)
    assert not logits(model, ids).any()


def test_weights_changed_after_packing_compute_plainly():
    model = small_llama()
    ids = torch.randint(0, 300, (1, 5))
    packed.pack_linears(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)  # in place: a new version
    model.to(torch.bfloat16)  # new storage and dtype for every weight
    with packed.packed_products():
        got = logits(model, ids)
    assert torch.equal(got, logits(model, ids))  # the plain products, no oneDNN error


def test_sibling_layers_are_found_and_share_one_product():
    model = small_llama()
    ids = torch.randint(0, 300, (1, 7))
    plain = logits(model, ids)
    with packed.sibling_inputs(model) as siblings:
        logits(model, ids)
    names = {id(m): n.split(".", 3)[-1] for n, m in model.named_modules()}
    assert [[names[id(m)] for m in g] for g in siblings] == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
    ] * 2
    assert packed.pack_linears(model, siblings) == sum(
        type(m) is torch.nn.Linear for m in model.modules()
    )
    with packed.packed_products():
        torch.testing.assert_close(logits(model, ids), plain, rtol=1e-4, atol=1e-4)
        # a member called with another input than its group's computes that input alone
        x = torch.randn(1, 3, 64)
        q_proj = model.model.layers[0].self_attn.q_proj
        torch.testing.assert_close(q_proj(x), x @ q_proj.weight.T, rtol=1e-4, atol=1e-4)


def test_one_and_two_row_products_match_f_linear_where_the_block_asks(tmp_path):
    small = packed.small_products(tmp_path)
    assert small is not None  # the test machine has a C compiler
    calls = [0]
    into = small.into

    def counted(*args):
        calls[0] += 1
        return into(*args)

    small.into = counted  # type: ignore[method-assign]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        torch.manual_seed(0)
        model = small_llama().to(dtype)
        with packed.sibling_inputs(model) as siblings:
            logits(model, torch.randint(0, 300, (1, 3)))
        assert packed.pack_linears(model, siblings, small) > 0
        for rows in (1, 2, 5):
            ids = torch.randint(0, 300, (1, rows))
            want = logits(model, ids).float()
            calls[0] = 0
            with packed.packed_products(small=True):
                got = logits(model, ids).float()
            assert (calls[0] > 0) == (rows <= packed.SMALL_ROWS)  # five rows: oneDNN's
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            calls[0] = 0
            with packed.packed_products(small=False):  # the twin: oneDNN at every size
                logits(model, ids)
            assert calls[0] == 0
