"""The prepared device check (`benchmarks/gpu_check.py`) end to end on CPU, so it cannot
rot between the rare sessions that get a GPU.

It runs `--device cpu --tiny` under a Python that holds only what the GPU machine brings (PyTorch,
Triton, transformers, pytest, matplotlib and what they require) plus the packages of the wheels
`make device-wheels` carries there (`scripts/device-wheels.txt`), all linked from this venv: an
import the GPU machine could not satisfy fails here first. The tokenizer comes from a folder, as
the carried one does there.
"""

from __future__ import annotations

import json
import os
import subprocess
import venv
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from services.models import resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]
WHEEL_LIST = ROOT / "scripts" / "device-wheels.txt"
# Among our needs, what the GPU machine's image holds (each with what it requires).
IMAGE = ("torch", "triton", "transformers", "pytest", "pytest-timeout", "matplotlib")
STEPS = [
    "1_cuda_tests",
    "2_greedy_equality",
    "3_throughput",
    "4_kv_tier",
    "5_attention_kernel",
    "6_decode_graphs",
    "7_outputs",
]


def pins() -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in WHEEL_LIST.read_text().splitlines())
    return dict(line.split("==") for line in lines if line)


def requirement_closure(names: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def bare_python(folder: Path) -> Path:
    """A venv whose site-packages links exactly the image's and the carried wheels' packages."""
    venv.create(folder, with_pip=False, symlinks=True)
    site = next(folder.glob("lib/python*/site-packages"))
    for name in requirement_closure([*IMAGE, *pins()]):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # a requirement only some platforms install
            continue
        for file in dist.files or []:
            top = Path(file).parts[0]
            if top.startswith(("..", "__pycache__")) or top.endswith(".pth"):
                continue
            src = Path(str(dist.locate_file(top)))
            # a namespace folder (opentelemetry) is shared by distributions we must not bring
            # along: link its files one by one; any other folder or module whole
            shared = src.is_dir() and not (src / "__init__.py").exists() and "." not in top
            if shared:
                src, dst = Path(str(dist.locate_file(file))), site / file
                dst.parent.mkdir(parents=True, exist_ok=True)
            else:
                dst = site / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    return folder / "bin" / "python"


def problems(entry: Any, path: str = "") -> list[str]:
    """Every place in the result where something failed or was skipped for want of time."""
    if isinstance(entry, dict):
        found = [
            f"{path}: {entry[k]}" for k in ("error", "skipped") if isinstance(entry.get(k), str)
        ]
        return found + [p for k, v in entry.items() for p in problems(v, f"{path}/{k}")]
    return []


def test_wheel_pins_are_the_versions_this_venv_runs():
    for name, version in pins().items():
        assert metadata.version(name) == version, f"{name}: scripts/device-wheels.txt is stale"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict[str, Any], str, Path]:
    tmp = tmp_path_factory.mktemp("gpu_check")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(resolve_model_dir(None)[1]).save_pretrained(tmp / "tokenizer")
    python = bare_python(tmp / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [python, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny"]
    cmd += ["--out", tmp / "out", "--tokenizer", tmp / "tokenizer"]
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "out" / "gpu_check.json").read_text()), proc.stdout, tmp / "out"


def test_one_key_per_step_and_nothing_failed(run):
    result, stdout, out = run
    assert sorted(k for k in result if k[0].isdigit()) == STEPS
    assert problems(result) == []
    assert "| step | result |" in stdout  # the table, printed last
    assert result["7_outputs"]["json"] == "gpu_check.json"
    assert (out / "gpu_check.png").stat().st_size > 0


def test_device_tests_are_found_and_skip_on_cpu(run):
    tests = run[0]["1_cuda_tests"]
    assert tests["rc"] == 0 and tests["failed"] == tests["errors"] == 0
    assert "tests/unit/test_kv_tier.py" in tests["files"]
    assert tests["skipped"] >= 1 and all("CUDA" in t for t in tests["skipped_tests"])


def test_float32_greedy_equals_hf_generate(run):
    eq = run[0]["2_greedy_equality"]
    assert eq["float32"]["equal"] == eq["float32"]["prompts"] == 5
    assert eq["float32"]["worst_forced_gap"] == 0.0
    assert eq["bfloat16"]["prompts"] == 5  # bf16 may part after a tie: reported, not asserted


def test_throughput_and_host_tier_report_every_run(run):
    result = run[0]
    for row in result["3_throughput"]["tiny"]["batches"].values():
        assert all(v is not None and v > 0 for v in row["ratios"].values())
        assert row["constrained_overlap"]["output_tokens"] > 0
    for key in ("batch_1", "batch_4"):  # the Triton kernel, interpreted, against the gather
        assert result["5_attention_kernel"][key]["max_abs_diff"] < 1e-4
        assert result["6_decode_graphs"][key]["same_tokens"]  # padded static forward, uncaptured
    assert result["6_decode_graphs"]["steps"]["uncaptured"] > 0
    for row in result["4_kv_tier"]["contexts"].values():
        for hot in ("hot_0x", "hot_1x"):
            assert row[hot]["same_tokens"]  # parked pages read back bit for bit
            assert row[hot]["mib_per_step"] > 0
