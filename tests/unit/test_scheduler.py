from kvcache.pages import PageAllocator
from services import SamplingParams
from services.engine.config import SchedulingConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler


def make_request(rid: str, n_prompt: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, n_prompt + 1)),
        params=SamplingParams(max_tokens=max_tokens),
        detokenizer=IncrementalDetokenizer(None, [], ()),
    )


def apply(out, token: int = 7) -> None:
    """What the engine does after the forward pass: advance, and append a token where sampled."""
    for c in out.chunks:
        c.request.num_computed_tokens += c.num_tokens
    for c in out.chunks:
        if c.start + c.num_tokens == c.request.num_computed_tokens == c.request.num_tokens:
            c.request.token_ids.append(token)


def sched(num_pages=100, **cfg) -> Scheduler:
    newcomer = cfg.pop("newcomer_steps", False)
    config = SchedulingConfig(**cfg)
    return Scheduler(config, 4, PageAllocator(num_pages), newcomer_steps=newcomer)


def test_chunked_prefill_fills_the_token_budget():
    s = sched(max_num_batched_tokens=25)
    reqs = [make_request(str(i), 10) for i in range(3)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("0", 0, 10),
        ("1", 0, 10),
        ("2", 0, 5),
    ]
    assert [c.samples for c in out.chunks] == [True, True, False]
    apply(out)
    out = s.schedule()
    # two decode tokens, then the rest of the third prompt
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("0", 10, 1),
        ("1", 10, 1),
        ("2", 5, 5),
    ]


def test_unchunked_prefill_waits_for_room():
    s = sched(max_num_batched_tokens=25, enable_chunked_prefill=False)
    for i in range(3):
        s.add(make_request(str(i), 10))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["0", "1"]
    assert len(s.waiting) == 1


def test_unchunked_long_prompt_runs_alone_rather_than_never():
    s = sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add(make_request("long", 20))
    out = s.schedule()
    assert [(c.num_tokens, c.samples) for c in out.chunks] == [(20, True)]


def test_max_num_seqs_caps_the_batch():
    s = sched(max_num_seqs=2)
    for i in range(4):
        s.add(make_request(str(i), 3))
    assert len(s.schedule().chunks) == 2
    assert len(s.waiting) == 2


def test_pages_grow_with_tokens_and_are_freed_at_finish():
    s = sched(num_pages=10)
    r = make_request("a", 4)
    s.add(r)
    apply(s.schedule())
    assert len(r.pages) == 1  # 4 tokens: one page of 4
    apply(s.schedule())  # the 5th token needs a second page
    assert len(r.pages) == 2
    s.finish(r)
    assert s.allocator.num_free == 10 and r.status is RequestStatus.FINISHED


def test_preemption_recomputes_the_latest_request():
    s = sched(num_pages=2)
    a, b = make_request("a", 4), make_request("b", 4)
    s.add(a)
    s.add(b)
    apply(s.schedule())  # both prompts fill the two pages, each samples a token
    out = s.schedule()  # each now needs a second page: b is preempted so a can go on
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert b.pages == [] and b.num_computed_tokens == 0 and b.num_tokens == 5
    assert s.waiting[0] is b and s.num_preemptions == 1
    s.finish(a)
    out = s.schedule()  # b comes back and recomputes prompt + its sampled token
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("b", 0, 5)]


def test_a_request_alone_that_cannot_grow_preempts_itself_without_looping():
    s = sched(num_pages=1)
    a = make_request("a", 4)
    s.add(a)
    apply(s.schedule())
    out = s.schedule()
    assert out.preempted == [a] and out.chunks == []
