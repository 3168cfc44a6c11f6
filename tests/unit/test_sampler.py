import math

import pytest
import torch

from services import SamplingParams
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.request import Request
from services.engine.sampler import Sampler, _min_p, _top_k_top_p


def req(seed=None, **kw) -> Request:
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return Request(
        "r", [1], SamplingParams(**kw), IncrementalDetokenizer(None, [], ()), generator=gen
    )


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    out = _top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).tolist() == [False, True, True, False]
    # softmax of [0,3,2,1]: 0.64 for token 1 already reaches 0.5
    assert torch.isfinite(out[1]).tolist() == [False, True, False, False]


def test_greedy_takes_argmax_and_sampling_respects_top_k():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.9]]).repeat(200, 1)
    assert sampler(logits[:1], [req(temperature=0)]).tokens == [2]
    drawn = sampler(logits, [req(temperature=1.0, top_k=2) for _ in range(200)]).tokens
    assert set(drawn) == {2, 3}


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    alone = Sampler(torch.device("cpu"))(logits[1:2], [req(seed=42)]).tokens
    mixed = Sampler(torch.device("cpu"), seed=7)(logits, [req(), req(seed=42), req(temperature=0)])
    assert mixed.tokens[1] == alone[0]


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-6, 0.0])
def test_a_temperature_too_small_to_sample_is_greedy(temperature):
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.9], [2.0, 1.0, 0.0, -1.0]])
    out = Sampler(torch.device("cpu"))(logits, [req(temperature=temperature), req(seed=3)])
    assert out.tokens[0] == 2 and not out.failed


def test_tiny_but_samplable_temperature_still_samples_without_overflow():
    # 1e-4 is above the greedy threshold: logits / t = 5e4, finite in float32
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.9]]).repeat(64, 1)
    out = Sampler(torch.device("cpu"))(logits, [req(temperature=1e-4) for _ in range(64)])
    assert set(out.tokens) == {2} and not out.failed


@pytest.mark.parametrize(
    "bad", [[math.nan, 1.0, 2.0], [math.inf, 1.0, 2.0], [-math.inf, -math.inf, -math.inf]]
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_unusable_row_fails_alone(bad, temperature):
    good = [0.0, 9.0, 1.0]
    logits = torch.tensor([good, bad, good])
    reqs = [req(temperature=0), req(temperature=temperature), req(seed=5)]
    out = Sampler(torch.device("cpu"))(logits, reqs)
    assert set(out.failed) == {1} and "not finite" in out.failed[1]
    assert out.tokens[0] == 1 and out.tokens[2] == 1


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-12])
def test_a_top_p_too_small_for_float32_keeps_the_best_token(top_p):
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.9]]).repeat(8, 1)
    out = Sampler(torch.device("cpu"))(logits, [req(top_p=top_p) for _ in range(8)])
    assert out.tokens == [2] * 8 and not out.failed


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(_min_p(logits, torch.tensor([0.5]))).tolist()
    assert kept == [[True, True, False, False]]  # 0.15 < 0.5 x 0.5
    assert torch.isfinite(_min_p(logits, torch.tensor([1.0]))).tolist() == [
        [True, False, False, False]
    ]
    drawn = Sampler(torch.device("cpu"))(logits.repeat(100, 1), [req(min_p=0.5)] * 100).tokens
    assert set(drawn) <= {0, 1} and set(drawn) == {0, 1}


def test_top_k_minus_one_and_above_the_vocabulary_cut_nothing():
    assert SamplingParams(top_k=-1).top_k == 0
    logits = torch.zeros(400, 3)
    out = Sampler(torch.device("cpu"))(logits, [req(top_k=10**6) for _ in range(400)])
    assert set(out.tokens) == {0, 1, 2}


def test_logprobs_are_of_the_sampled_token_from_the_masked_logits():
    logits = torch.tensor([[0.0, 1.0, 5.0, float("-inf")], [3.0, 2.0, 1.0, 0.0]])
    reqs = [req(temperature=0, logprobs=2), req(seed=1, temperature=0.7)]
    out = Sampler(torch.device("cpu"))(logits, reqs)
    assert set(out.logprobs) == {0}  # only the row that asked
    lp = out.logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert lp.token_id == 2 and abs(lp.logprob - expected[2].item()) < 1e-6
    assert [t for t, _ in lp.top] == [2, 1]
    assert abs(lp.top[1][1] - expected[1].item()) < 1e-6


def test_logprobs_zero_gives_the_sampled_token_alone():
    out = Sampler(torch.device("cpu"))(
        torch.randn(1, 9), [req(temperature=1.0, seed=3, logprobs=0)]
    )
    assert out.logprobs[0].top == () and out.logprobs[0].token_id == out.tokens[0]
