"""The decode graphs' padded forward over static buffers (services/engine/decode_graphs.py), run
uncaptured on CPU, gives the greedy tokens of eager steps on SmolLM2: batches that shrink through
the padded sizes as rows finish (5 rows pad to 8, then 4, 2, 1), a constrained row whose mask
is applied outside the forward, and steps that do not qualify (a Quest row) run eagerly beside.
On CUDA the same forward is what `decode_graphs="auto"` captures and replays."""

from __future__ import annotations

from services import LLM, KVPolicy, SamplingParams, StructuredOutput

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
]


def generate(loaded_model, mode: str, quest: bool = False) -> tuple[list[list[int]], LLM]:  # type: ignore[no-untyped-def]
    # one token a row a step (a drafted step is not a graph's): every decode step qualifies
    kw = {"kv_cache_memory": 32 << 20, "grammar_workers": 0, "speculative": None}
    llm = LLM(loaded=loaded_model, decode_graphs=mode, **kw)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 6, 9, 12)]
    schema = StructuredOutput(json_schema=PERSON)
    chat = llm.engine.apply_chat_template([{"role": "user", "content": "A person as JSON."}])
    prompts: list = [*PROMPTS, chat]
    params.append(SamplingParams(max_tokens=30, temperature=0.0, structured=schema))
    if quest:
        policy = KVPolicy(kind="quest", budget_tokens=16, dense_layers=2)
        prompts.append(PROMPTS[2] * 4)
        params.append(SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, kv=policy))
    outs = llm.generate(prompts, params)
    assert all(o.finish_reason in ("stop", "length") for o in outs), [o.warnings for o in outs]
    return [o.token_ids for o in outs], llm


def test_padded_static_forward_gives_the_eager_tokens(loaded_model):
    eager, plain = generate(loaded_model, "off")
    assert plain.engine.runner.graphs is None
    padded, llm = generate(loaded_model, "uncaptured")
    assert padded == eager
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.uncaptured >= 10


def test_steps_that_do_not_qualify_run_eagerly_beside(loaded_model):
    eager, _ = generate(loaded_model, "off", quest=True)
    padded, llm = generate(loaded_model, "uncaptured", quest=True)
    assert padded == eager
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.uncaptured > 0  # after the Quest row finished
