"""`make serve` until the Ray Serve application lands: the engine on the default model, offline.

Streams a few chat answers through the async interface the service will use, prints the figures,
then (on a terminal) answers prompts you type. Ctrl-D or an empty line ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from services.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.async_llm import AsyncLLM

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
]


async def _answer(llm: AsyncLLM, question: str, max_tokens: int, echo: bool) -> int:
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": question}])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    n = 0
    async for out in llm.generate(prompt, params):
        n = len(out.token_ids)
        if echo:
            print(out.delta_text, end="", flush=True)
        if out.finished and out.warnings:
            print(f"\n[refused: {'; '.join(out.warnings)}]")
    return n


async def main_async(args: argparse.Namespace) -> None:
    print("loading the model (the first run converts it once, ~1 minute)...", flush=True)
    llm = AsyncLLM(LLMEngine(EngineConfig(model=args.model)))
    try:
        print(f"\n# {len(QUESTIONS)} questions answered concurrently, streamed\n")
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(_answer(llm, q, args.max_tokens, echo=(i == 0)) for i, q in enumerate(QUESTIONS))
        )
        elapsed = time.perf_counter() - start
        print(f"\n\n{sum(counts)} tokens in {elapsed:.1f} s ({sum(counts) / elapsed:.1f} tok/s)")
        if not sys.stdin.isatty():
            return
        while True:
            question = await asyncio.to_thread(input, "\nyou> ")
            if not question.strip():
                return
            print("model> ", end="")
            await _answer(llm, question, args.max_tokens, echo=True)
    except EOFError:
        return
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a local Hugging Face model folder")
    parser.add_argument("--max-tokens", type=int, default=96)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
