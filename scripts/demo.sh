#!/usr/bin/env bash
# The main job on its embedded default: APB-V attention on 2 CPU (gloo) ranks, compared with
# exact causal attention. Extra arguments go to `python -m apbv demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m apbv demo "$@"
