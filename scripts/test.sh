#!/usr/bin/env bash
# The test suite (CPU only; GPU tests skip with their reason). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
