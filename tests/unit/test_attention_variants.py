"""Per-layer attention variants (kvcache/variants.py): windowed masks keep each query's last
`window` keys, soft-capped attention equals its definition, and an argument the paged attention
does not implement is refused instead of ignored."""

from __future__ import annotations

import pytest
import torch

from kvcache import variants


def test_a_windowed_mask_keeps_each_querys_last_keys():
    starts = torch.tensor([0, 5])  # row 0: a prompt of 4 from 0; row 1: decoding at 5..8
    q_pos = starts[:, None] + torch.arange(4)[None, :]
    k_pos = torch.arange(12)
    causal = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]
    got = variants.windowed(causal, 3)
    want = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] > q_pos[:, :, None] - 3
    )
    assert torch.equal(got, want[:, None])


def test_the_causal_chunk_mask_with_a_window():
    m = variants.causal(5, 2, torch.device("cpu"))[0, 0]
    assert m.tolist()[4] == [False, False, False, True, True]
    assert torch.equal(
        variants.causal(5, None, torch.device("cpu"))[0, 0], torch.ones(5, 5).tril().bool()
    )


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_softcapped_attention_is_its_definition(kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 8) * 3
    k = torch.randn(2, kv_heads, 7, 8) * 3
    v = torch.randn(2, kv_heads, 7, 8)
    mask = torch.rand(2, 1, 3, 7) > 0.3
    mask[..., 0] = True
    got = variants.softcapped_attention(q, k, v, mask, 0.25, 5.0)
    kk = k.repeat_interleave(4 // kv_heads, dim=1)
    vv = v.repeat_interleave(4 // kv_heads, dim=1)
    logits = torch.tanh((q @ kk.transpose(-1, -2)) * 0.25 / 5.0) * 5.0
    want = logits.masked_fill(~mask, float("-inf")).softmax(-1) @ vv
    assert torch.allclose(got, want, atol=1e-6)


def test_arguments_the_paged_attention_does_not_implement_are_refused():
    with pytest.raises(variants.UnsupportedAttention, match="s_aux"):
        variants.layer_variant(0, {"s_aux": torch.zeros(4), "sliding_window": 8})
    v = variants.layer_variant(0, {"s_aux": None, "position_ids": torch.zeros(1), "softcap": None})
    assert v.window is None and v.softcap is None  # None values change nothing


def test_the_probe_records_each_layers_variant():
    with variants.probing() as profile:
        variants.layer_variant(0, {"sliding_window": 8})
        variants.layer_variant(1, {})
        variants.layer_variant(2, {"softcap": 50.0})
    assert profile.calls == 3 and profile.windows == {0: 8}
    assert profile.describe() == "sliding windows (1 layers, 8 tokens), soft-capped logits"
    variants.layer_variant(0, {"sliding_window": 8})  # outside a probe: nothing recorded
    assert profile.calls == 3


def test_the_share_of_the_kv_outside_the_windows():
    profile = variants.AttentionProfile()
    for layer in range(5):  # Gemma 3's pattern: 5 local layers of 512, then a global one
        profile.layers[layer] = variants.LayerVariant(window=512)
    assert profile.window_saving(6, 32768) == pytest.approx(5 / 6 * (1 - 512 / 32768))
    assert profile.window_saving(6, 256) == 0.0  # windows longer than the context save nothing
