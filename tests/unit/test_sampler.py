import torch

from services import SamplingParams
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.request import Request
from services.engine.sampler import Sampler, _top_k_top_p


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
    assert sampler(logits[:1], [req(temperature=0)]) == [2]
    drawn = sampler(logits, [req(temperature=1.0, top_k=2) for _ in range(200)])
    assert set(drawn) == {2, 3}


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    alone = Sampler(torch.device("cpu"))(logits[1:2], [req(seed=42)])
    mixed = Sampler(torch.device("cpu"), seed=7)(logits, [req(), req(seed=42), req(temperature=0)])
    assert mixed[1] == alone[0]
