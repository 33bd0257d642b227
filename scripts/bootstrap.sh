#!/usr/bin/env bash
# Create .venv (once) and install apbv with its test extra into it; re-runs only when
# pyproject.toml changes. Override the torch pin with APBV_TORCH (e.g. for a CUDA cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_spec=${APBV_TORCH:-"torch==2.14.1 torchvision==0.29.1"}
stamp=.venv/.apbv-installed
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1) $torch_spec"
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "[apbv] setting up .venv (first run takes a few minutes; a line per package) ..." >&2
[ -x .venv/bin/python ] || "$python" -m venv .venv
log=.venv/install.log
# pip's whole output goes to the log; a line per package it fetches or installs to stderr
set +e
# shellcheck disable=SC2086  # torch_spec holds several requirements
{ .venv/bin/pip install $torch_spec && .venv/bin/pip install -e ".[test]"; } 2>&1 | tee "$log" |
  { grep --line-buffered -E '^(Collecting|Installing collected packages|Successfully installed)' |
    sed -u 's/^/[apbv] /' >&2; true; }
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  tail -n 40 "$log" >&2
  echo "[apbv] installation failed; full log in $log" >&2
  exit 1
fi
echo "$want" >"$stamp"
echo "[apbv] .venv ready" >&2
