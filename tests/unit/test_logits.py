"""The logits processors against plain per-row references, and batched against one row at a time."""

from __future__ import annotations

import pytest
import torch

from services import SamplingParams, StructuredOutput
from services.engine import logits as processors
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.request import Request, StructuredRequest

V = 12


def req(prompt: list[int], output: list[int], eos=frozenset({11}), **kw) -> Request:
    r = Request(
        "r", prompt, SamplingParams(max_tokens=20, **kw), IncrementalDetokenizer(None, [], ())
    )
    r.token_ids = prompt + output
    r.eos_token_ids = eos
    return r


def reference(logits: torch.Tensor, r: Request) -> torch.Tensor:
    """One row, the textbook way."""
    out = logits.clone()
    p = r.params
    for t in set(r.token_ids):
        if p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        out[t] -= p.presence_penalty + p.frequency_penalty * r.output_token_ids.count(t)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    if r.num_output_tokens < p.min_tokens:
        for t in r.eos_token_ids | set(p.stop_token_ids or ()):
            out[t] = float("-inf")
    return out


ROWS = [
    lambda: req([1, 2, 3], [3, 3, 4], repetition_penalty=1.5),
    lambda: req([1, 2], [5, 5, 5, 6], presence_penalty=0.5, frequency_penalty=0.25),
    lambda: req([0], [7], logit_bias={7: -3.0, 9: 100.0}),
    lambda: req([4], [], min_tokens=2, stop_token_ids=[10]),
    lambda: req([4, 5], [6]),  # asks for nothing: untouched
    lambda: req(
        [2, 2], [2, 8, 8], repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2.0
    ),
]


def test_each_processor_matches_its_per_row_reference():
    logits = torch.randn(len(ROWS), V, generator=torch.Generator().manual_seed(0)) * 3
    reqs = [make() for make in ROWS]
    expected = torch.stack([reference(logits[i], r) for i, r in enumerate(reqs)])
    batched = logits.clone()
    processors.apply(batched, reqs)
    assert torch.allclose(batched, expected, equal_nan=True)
    assert torch.equal(batched[4], logits[4])


@pytest.mark.parametrize("i", range(len(ROWS)))
def test_batched_equals_one_row_at_a_time(i):
    logits = torch.randn(len(ROWS), V, generator=torch.Generator().manual_seed(1))
    reqs = [make() for make in ROWS]
    batched = logits.clone()
    processors.apply(batched, reqs)
    alone = logits[i : i + 1].clone()
    processors.apply(alone, [reqs[i]])
    assert torch.equal(batched[i], alone[0])


def test_min_tokens_leaves_a_constrained_request_to_its_grammar():
    r = req([4], [], min_tokens=3)
    r.structured = StructuredRequest(StructuredOutput(choice=["a"]), state=object())  # type: ignore[arg-type]
    logits = torch.zeros(1, V)
    processors.apply(logits, [r])
    assert torch.isfinite(logits).all()


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("stop here stop there", add_special_tokens=False)
    first = IncrementalDetokenizer(tokenizer, [], ("stop",))
    first.add_tokens(ids)
    assert first.stopped and first.text == ""
    later = IncrementalDetokenizer(tokenizer, [], ("stop",), min_tokens=3)
    later.add_tokens(ids)
    assert later.stopped and later.text.startswith("stop here")
