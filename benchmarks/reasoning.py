"""Thinking and calls cost what plain JSON costs: throughput of `LLM.chat` with a thinking block
before a schema, and with required tool calls, against the same schema without thinking, on the
same model (services/dialects, services/engine/chat.py).

The model is the default SmolLM2 with a Qwen3-Thinking-style chat template (tools in the system
turn, Hermes calls, a generation prompt that opens `<think>`; `enable_thinking=False` closes an
empty block instead), so its dialect is detected as `qwen_3`. Workloads, each a batch of
`--batch` conversations, greedy, `--max-tokens`:
- `schema`: a response format's schema, thinking off: the plain JSON path (no structural tag);
- `thinking+schema`: thinking on with `thinking_token_budget` (`--budget`), then the schema: one
  structural tag, the block free text under it;
- `tools`: thinking off, `tool_choice="required"`: the dialect's calls.
Run in the order schema, thinking+schema, tools, tools, thinking+schema, schema; tokens/s of
each (best of its two runs) and its ratio to `schema` (target >= 0.9: the block's masks and the
tag cost nothing more than JSON's). Writes `benchmarks/results/reasoning.json`.

`--http` runs the same workloads over HTTP instead, as users send them: `structserve serve` on
the same folder, the batch sent at once through the real `openai` client (the ingress then also
reads each answer back into reasoning, content and calls). Writes `reasoning_http.json`.

    .venv/bin/python benchmarks/reasoning.py [--batch 8] [--max-tokens 96] [--budget 32] [--http]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services import LLM, SamplingParams, StructuredOutput  # noqa: E402
from services.models.loader import resolve_model_dir  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["city", "population", "landmarks"],
}
TOOLS = [{"type": "function", "function": {"name": "city_facts", "parameters": SCHEMA}}]
CITIES = ["Oslo", "Lima", "Kyoto", "Accra", "Quito", "Perth", "Turin", "Hanoi", "Cork", "Riga"]


def folder_with_template(tmp: Path) -> str:
    """The default model's folder, its weights linked, with the thinking template."""
    source = Path(resolve_model_dir(None)[1])
    for item in source.iterdir():
        if item.is_file():
            (tmp / item.name).symlink_to(item)
    config = tmp / "tokenizer_config.json"
    data = json.loads((source / "tokenizer_config.json").read_text())
    config.unlink()
    config.write_text(json.dumps({**data, "chat_template": TEMPLATE}))
    for extra in ("chat_template.jinja", "chat_template.json"):
        if (tmp / extra).exists():
            (tmp / extra).unlink()
    return str(tmp)


def workload(name: str, args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """`chat` keywords and the params of one workload."""
    plain = {"max_tokens": args.max_tokens, "temperature": 0}
    schema = StructuredOutput(json_schema=SCHEMA)
    if name == "schema":
        kw = {"chat_template_kwargs": {"enable_thinking": False}}
        return kw, SamplingParams(**plain, structured=schema)
    if name == "thinking+schema":
        budget = {"thinking_token_budget": args.budget}
        return {}, SamplingParams(**plain, **budget, structured=schema)
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    return {**kw, "chat_template_kwargs": {"enable_thinking": False}}, SamplingParams(**plain)


def run(llm: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    kw, params = workload(name, args)
    convs = [
        [{"role": "user", "content": f"Give facts about {CITIES[i % len(CITIES)]} as JSON."}]
        for i in range(args.batch)
    ]
    start = time.perf_counter()
    outs = llm.chat(convs, params, **kw)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "reasoning": sum(bool(o.reasoning_text) for o in outs),
        "calls": sum(len(o.tool_calls or ()) for o in outs),
        "finished": sum(o.finish_reason == "stop" for o in outs),
    }


class Served:
    """`structserve serve` on `folder`, called through the `openai` client like `LLM.chat`."""

    KEY = "sk-reasoning-bench"

    def __init__(self, folder: str, port: int) -> None:
        import openai

        cmd = [sys.executable, "-m", "deployments.cli", "serve", "--model", folder]
        cmd += ["--port", str(port), "--api-key", self.KEY]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for line in self.proc.stdout or ():
            print(f"  {line.rstrip()}")
            if "ready at" in line:
                break
        base = f"http://127.0.0.1:{port}/v1"
        self.client = openai.OpenAI(base_url=base, api_key=self.KEY, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def chat(self, convs: list[list[dict]], params: SamplingParams, **kw: Any) -> list[Any]:
        """The batch at once, one client thread per conversation."""
        body: dict[str, Any] = {"model": self.model, "temperature": 0}
        body |= {"max_tokens": params.max_tokens}
        extra: dict[str, Any] = {}
        if params.structured is not None:
            schema = {"name": "facts", "schema": params.structured.json_schema}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if params.thinking_token_budget is not None:
            extra["thinking_token_budget"] = params.thinking_token_budget
        if "chat_template_kwargs" in kw:
            extra["chat_template_kwargs"] = kw.pop("chat_template_kwargs")
        body |= kw

        def one(messages: list[dict]) -> Any:
            got = self.client.chat.completions.create(messages=messages, extra_body=extra, **body)
            message = got.choices[0].message
            return SimpleNamespace(
                token_ids=range(got.usage.completion_tokens),
                reasoning_text=(message.model_extra or {}).get("reasoning_content"),
                tool_calls=message.tool_calls,
                finish_reason="stop" if got.choices[0].finish_reason != "length" else "length",
            )

        with ThreadPoolExecutor(len(convs)) as pool:
            return list(pool.map(one, convs))

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--http", action="store_true", help="through `structserve serve`")
    parser.add_argument("--port", type=int, default=8031)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    try:
        folder = folder_with_template(tmp)
        llm: Any = Served(folder, args.port) if args.http else LLM(folder)
        if not args.http:
            print(f"dialect: {llm.dialect}")
        run(llm, "schema", args)  # warm: grammars compiled, caches filled
        order = ["schema", "thinking+schema", "tools", "tools", "thinking+schema", "schema"]
        runs: dict[str, list[dict[str, Any]]] = {}
        for name in order:
            got = run(llm, name, args)
            runs.setdefault(name, []).append(got)
            print(f"  {name:16s} {got['tokens_per_s']:7.1f} tok/s  {json.dumps(got)}")
        best = {k: max(r["tokens_per_s"] for r in v) for k, v in runs.items()}
        ratios = {k: best[k] / best["schema"] for k in best}
        for k in best:
            print(f"{k:16s} best {best[k]:7.1f} tok/s   vs schema {ratios[k]:.2f}x")
        RESULTS.mkdir(exist_ok=True)
        out = {"args": vars(args), "runs": runs, "best": best, "ratios": ratios}
        name = "reasoning_http.json" if args.http else "reasoning.json"
        (RESULTS / name).write_text(json.dumps(out, indent=2))
        if args.http:
            llm.close()
        else:
            llm.engine.grammars.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
