#!/usr/bin/env bash
# The test suite (CPU only; GPU tests skip with their reason). Extra arguments go to pytest.
# Test files run in APBV_TEST_WORKERS processes (default 2, one a core of the CI machine; 0: in
# this process), each file whole in one of them, so a module's server starts once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -n "${APBV_TEST_WORKERS:-2}" --dist loadfile "$@"
