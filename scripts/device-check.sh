#!/usr/bin/env bash
# The prepared device check on a bare CUDA machine that has PyTorch, Triton,
# transformers, pytest and matplotlib and no network: installs the wheels `make device-wheels`
# put in .device-wheels/ (offline, into a scratch folder on PYTHONPATH), then runs
# benchmarks/gpu_check.py, writing gpu_check.json, gpu_check.png and gpu_check.log under $OUT.
#
#   bash scripts/device-check.sh [gpu_check.py options, e.g. --steps 3,4 --models 1b]
#
# About 8 minutes at most: the check starts no new run after its budget (360 s) and is stopped
# at 450 s whatever it is doing; its JSON is rewritten after every step, so what it measured
# stays. DEVICE_CHECK_INSTALL=0 skips the install (a dry run where the packages are present:
# PYTHON=.venv/bin/python DEVICE_CHECK_INSTALL=0 bash scripts/device-check.sh --device cpu --tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${DEVICE_WHEELS:-.device-wheels}
OUT=${OUT:-benchmarks/results}
start=$(date +%s)

if [[ "${DEVICE_CHECK_INSTALL:-1}" != 0 ]]; then
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "no wheels in $WHEELS: run 'make device-wheels' first and carry that folder" >&2
        exit 2
    fi
    site=$(mktemp -d)/site
    # --no-deps: the list is complete by construction (tests/integration/test_gpu_check.py);
    # a resolver would look for torch among the wheels and fail
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed $(compgen -G "$WHEELS/*.whl" | wc -l) wheels in $(($(date +%s) - start)) s"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
fi
tokenizer=()
if [[ -f "$WHEELS/tokenizer/tokenizer.json" ]]; then
    tokenizer=(--tokenizer "$WHEELS/tokenizer")
fi
mkdir -p "$OUT"
set +e
timeout 450 "$PYTHON" benchmarks/gpu_check.py --device cuda "${tokenizer[@]}" --out "$OUT" "$@" \
    2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "device check: exit $rc after $(($(date +%s) - start)) s"
exit "$rc"
