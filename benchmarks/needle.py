"""Passkey retrieval for `long_context.py`: haystacks, the two question protocols, the table.

A haystack is the essays with "The password is NNNNN." inserted after a sentence at a depth; each
(context, depth, seed) is one haystack with its own key, so a cell of the table is the share of
its haystacks found, with a 95% Wilson interval (12 haystacks: one miss is 8 points, not 25).

Protocols:
- `after` (Quest's): the haystack is the prompt; the question is fed token by token as decode
  steps (teacher forcing), so a query-aware policy (Quest) selects pages with the question's
  queries; then the answer is decoded greedily.
- `inside` (SnapKV's): the question ends the prompt, so SnapKV's observation window sees it;
  the answer is decoded greedily.

Every config of a haystack runs in one batch (the prompt is prefilled once for the policies that
share pages: dense and Quest). `read` is the share of the context a decode step reads, averaged
over layers (Quest: every page in its `dense_layers`, its budget in the others; evicting
policies: what they keep); the second share counts bytes, adding the key bounds Quest scores
every page with (1 / `quest_bound_tokens` of the KV in each selecting layer).
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

from services import LLM, KVPolicy, SamplingParams
from services.engine.engine import LLMEngine
from services.engine.request import Request

# A passkey task SmolLM2-135M solves with dense attention at 2k-4k tokens of essays (the classic
# "The pass key is ..." sentence, unmarked, it misses at 4k even dense)
INTRO = (
    "Below is a long text. Somewhere inside it is a password. Read carefully and remember it.\n\n"
)
NEEDLE = "\n\nThe password is {key}.\n\n"
QUESTION = "\n\nWhat is the password? The password is"
ANSWER_TOKENS = 7
PROTOCOLS = ("after", "inside")
FRACTIONS = {"1/16": 1 / 16, "1/8": 1 / 8, "1/4": 1 / 4}


def parse_config(name: str, ctx: int, page_size: int) -> KVPolicy | None:
    """`dense`, or `kind[+variant...]@fraction`, variants `union` (`quest_heads="union"`) and
    `dN` (`dense_layers=N`), e.g. `quest@1/8`, `quest+union+d4@1/8`, `h2o@1/4`."""
    if name == "dense":
        return None
    kind, _, frac = name.partition("@")
    kind, *variants = kind.split("+")
    budget = max(page_size, round(ctx * FRACTIONS[frac] / page_size) * page_size)
    extra: dict[str, Any] = {}
    for v in variants:
        if v == "union":
            extra["quest_heads"] = "union"
        elif v[:1] == "d" and v[1:].isdigit():
            extra["dense_layers"] = int(v[1:])
        else:
            raise SystemExit(f"{name}: unknown variant {v!r} (union, dN)")
    return KVPolicy(kind=kind, budget_tokens=budget, **extra)


def read_share(kv: KVPolicy | None, ctx: int, layers: int) -> float:
    """The share of the context one decode step reads, averaged over the layers."""
    if kv is None:
        return 1.0
    budget = min(ctx, kv.budget)
    if kv.kind != "quest":
        return budget / ctx
    dense = min(kv.dense_layers, layers)
    return (dense * ctx + (layers - dense) * budget) / (layers * ctx)


def bytes_share(kv: KVPolicy | None, ctx: int, layers: int, bound_tokens: int) -> float:
    """`read_share` in bytes, counting what Quest scores pages with: in each selecting layer the
    key min and max of every `bound_tokens` tokens (two vectors, as keys and values are two per
    token), so 1 / bound_tokens of the context's KV bytes on top of the pages it reads."""
    share = read_share(kv, ctx, layers)
    if kv is None or kv.kind != "quest":
        return share
    selecting = layers - min(kv.dense_layers, layers)
    return share + selecting / layers / bound_tokens


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% interval of a share from `hits` of `n` (Wilson score), in percent."""
    if n == 0:
        return (0.0, 100.0)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (100 * max(0.0, centre - half), 100 * min(1.0, centre + half))


def needle_prompt(
    tok: Any, essay: list[int], ctx: int, depth: float, key: int, offset: int
) -> tuple[list[int], list[int]]:
    """The haystack (`ctx` tokens with the question) from `offset` into the essays, and the
    question's tokens."""
    intro = tok.encode(INTRO, add_special_tokens=False)
    needle = tok.encode(NEEDLE.format(key=key), add_special_tokens=False)
    question = tok.encode(QUESTION, add_special_tokens=False)
    body = ctx - len(intro) - len(needle) - len(question)
    text = essay[offset : offset + body]
    at = int(body * depth)
    period = tok.encode(".", add_special_tokens=False)[0]
    while at < body - 1 and text[at - 1] != period:  # insert after a sentence
        at += 1
    return intro + text[:at] + needle + text[at:], question


def run_batch(
    engine: LLMEngine,
    prompt: list[int],
    question: list[int],
    kvs: list[KVPolicy | None],
    protocol: str,
) -> list[str]:
    """The answers of one haystack under every config."""
    forced = question if protocol == "after" else []
    full = prompt if forced else prompt + question
    params = [
        SamplingParams(
            max_tokens=len(forced) + ANSWER_TOKENS, temperature=0, ignore_eos=True, kv=kv
        )
        for kv in kvs
    ]
    reqs = [engine.add_request(full, sp) for sp in params]
    for r in reqs:
        if r.finished:
            raise SystemExit(f"refused: {r.warnings}")
    while engine.has_unfinished():
        engine.step()
        if forced:
            _teacher_force(reqs, forced)
    answers = [
        engine.tokenizer.decode(r.token_ids[r.num_prompt_tokens + len(forced) :]) for r in reqs
    ]
    for r in reqs:
        engine.release(r.request_id)
    return answers


def _teacher_force(reqs: list[Request], question: list[int]) -> None:
    """The token just sampled is replaced by the next question token."""
    for r in reqs:
        n = min(r.num_output_tokens, len(question))
        r.token_ids[r.num_prompt_tokens : r.num_prompt_tokens + n] = question[:n]


def needle_section(
    llm: LLM,
    essay: list[int],
    contexts: list[int],
    depths: list[float],
    seeds: int,
    protocols: list[str],
    configs: list[str],
) -> dict:
    """found[protocol][config][ctx] = [bool per haystack]; read[config][ctx] = share read;
    bytes[config][ctx] = share of the KV bytes read, with Quest's bounds."""
    engine = llm.engine
    ps = engine.config.page_size
    bound_tokens = engine.config.quest_bound_tokens or ps
    layers = int(engine.runner.model.config.num_hidden_layers)
    found: dict[str, dict[str, dict[int, list[bool]]]] = {}
    read: dict[str, dict[int, float]] = {}
    read_bytes: dict[str, dict[int, float]] = {}
    for ctx in contexts:
        kvs = [parse_config(name, ctx, ps) for name in configs]
        for name, kv in zip(configs, kvs, strict=True):
            read.setdefault(name, {})[ctx] = read_share(kv, ctx, layers)
            read_bytes.setdefault(name, {})[ctx] = bytes_share(kv, ctx, layers, bound_tokens)
        for depth in depths:
            for seed in range(seeds):
                rng = random.Random(f"{ctx}/{depth}/{seed}")
                key = rng.randrange(10000, 99999)
                offset = rng.randrange(0, max(1, len(essay) - ctx))
                prompt, question = needle_prompt(llm.tokenizer, essay, ctx, depth, key, offset)
                for protocol in protocols:
                    t0 = time.perf_counter()
                    answers = run_batch(engine, prompt, question, kvs, protocol)
                    for name, answer in zip(configs, answers, strict=True):
                        cell = found.setdefault(protocol, {}).setdefault(name, {})
                        cell.setdefault(ctx, []).append(str(key) in answer)
                    ok = sum(str(key) in a for a in answers)
                    print(
                        f"  needle {protocol} ctx={ctx} depth={depth:g} seed={seed}: {ok}/"
                        f"{len(configs)} found {key} in {time.perf_counter() - t0:.0f} s",
                        flush=True,
                    )
    return {"found": found, "read": read, "bytes": read_bytes}


def print_table(needle: dict, contexts: list[int]) -> dict:
    """Accuracy (%) with its interval per protocol, config and context; returns it as JSON."""
    table: dict[str, Any] = {}
    for protocol, rows in needle["found"].items():
        print(
            f"\npasskey found, protocol '{protocol}': % [95% interval] "
            "(share of the context read / of its KV bytes, with Quest's bounds)"
        )
        print("config".ljust(18) + "".join(f"{c:>29}" for c in contexts))
        for name, cells in rows.items():
            line = name.ljust(18)
            for ctx in contexts:
                hits, n = sum(cells[ctx]), len(cells[ctx])
                lo, hi = wilson(hits, n)
                pct = 100 * hits / n
                share, nbytes = needle["read"][name][ctx], needle["bytes"][name][ctx]
                line += f"{pct:6.0f} [{lo:3.0f}-{hi:3.0f}] ({share:4.2f} / {nbytes:4.2f})".rjust(29)
                table.setdefault(protocol, {}).setdefault(name, {})[ctx] = {
                    "accuracy": pct,
                    "interval": [lo, hi],
                    "haystacks": n,
                    "read_share": share,
                    "bytes_share": nbytes,
                }
            print(line)
    return table
