"""`structserve serve` makes Ray's settings (loopback, token auth) before ray is imported: Ray
reads them at import, so settings made later would never reach it (and `local_ray.start`
refuses to run then)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs the CLI up to the point where it would start Ray, then stops.
PROBE = """
import sys
from deployments import cli, local_ray

def start(**kwargs):
    changed = local_ray.environment()  # False when the CLI made the settings already
    print("ray imported:", "ray" in sys.modules, "settings made late:", changed)
    raise SystemExit(3 if changed else 0)

local_ray.start = start
cli.main(["serve", "--api-key", "sk-" + "k" * 24])
"""


def test_serve_makes_rays_settings_before_importing_ray():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    run = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "ray imported: True settings made late: False" in run.stdout
