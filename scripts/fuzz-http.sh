#!/usr/bin/env bash
# A longer property-based fuzz of the HTTP bodies than `make test` runs: every operation of the
# ingress's OpenAPI document, EXAMPLES bodies each (default 400), against the real server.
# No 5xx and no hang is the property. Usage: scripts/fuzz-http.sh [EXAMPLES]
set -euo pipefail
cd "$(dirname "$0")/.."
export STRUCTSERVE_FUZZ_EXAMPLES=${1:-400}
exec .venv/bin/python -m pytest -q -p no:cacheprovider -p no:warnings \
  "tests/e2e/test_containment_http.py::test_fuzzed_requests_never_get_a_server_error_or_hang"
