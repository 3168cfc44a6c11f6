"""The pieces of speculative decoding that need no model: the n-gram drafter, the sampling rule
that keeps the output distribution, and the settings."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import SpeculativeConfig
from services.engine.sampler import accept_or_resample
from services.engine.speculative import ngram_draft


@pytest.mark.parametrize(
    ("tokens", "n_min", "n_max", "k", "draft"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 1, 3, 2, [9, 1]),  # the suffix [1, 2, 3] occurred at 0
        ([1, 2, 3, 9, 1, 2, 3], 1, 3, 9, [9, 1, 2, 3]),  # no further than the end
        ([5, 1, 2, 7, 4, 1, 2, 8, 1, 2], 2, 2, 1, [8]),  # the latest occurrence wins
        ([5, 6, 9, 3, 6, 9, 4, 1, 6, 9], 2, 3, 1, [4]),  # no 3-gram: the 2-gram's latest
        ([1, 2, 3, 4], 1, 3, 2, []),  # nothing repeats
        ([7, 7], 2, 2, 2, []),  # too short for a 2-gram to occur before the suffix
        ([7, 7, 7], 1, 2, 3, [7]),  # [7, 7] occurred at 0; only one token follows it
        ([3, 4, 3], 1, 4, 0, []),  # k = 0
    ],
)
def test_ngram_draft(tokens, n_min, n_max, k, draft):
    assert ngram_draft(tokens, n_min, n_max, k) == draft


def test_the_rejection_rule_keeps_the_distribution():
    """Tokens drawn by accept_or_resample against any draft follow p: a chi-square test over
    60,000 draws on a 6-token vocabulary (drafts chosen to be often wrong and often right)."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    counts = torch.zeros(6)
    draws = 60_000
    for i in range(draws):
        draft = (0, 5, 2)[i % 3]
        counts[accept_or_resample(probs, draft, gen)] += 1
    expected = probs * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts / draws)  # 5 degrees of freedom: p < 0.001 beyond 20.5
    # and the rule is not a plain draw that ignores the draft: a draft of certainty is kept
    certain = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert {accept_or_resample(certain, 1, gen) for _ in range(50)} == {1}
    never = torch.tensor([0.5, 0.0, 0.5, 0.0, 0.0, 0.0])
    assert 1 not in {accept_or_resample(never, 1, gen) for _ in range(200)}


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"method": "eagle"}, "speculative.method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min/max"),
        ({"lookahead": 3}, "unknown keys ['lookahead']"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"draft_length": "long"}, "draft_length"),
        ("ngram", "a dict of vLLM's keys"),
    ],
)
def test_bad_settings_fail_at_start_up_naming_the_key(value, error):
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.parse(value)


def test_vllm_keys_are_taken_as_given():
    cfg = SpeculativeConfig.parse(
        {
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 6,
            "prompt_lookup_min": 1,
        }
    )
    assert cfg == SpeculativeConfig("ngram", 5, 6, 1)
    assert SpeculativeConfig.parse(None) is None
