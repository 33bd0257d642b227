#!/usr/bin/env bash
# Run the model tests under another transformers version, without touching .venv:
#   bash scripts/compat.sh VERSION [pytest args]      e.g. bash scripts/compat.sh 4.57.6 -q
# transformers==VERSION (and the tokenizers / huggingface-hub it needs, when .venv's do not
# fit its requirements) are installed with --no-deps into .cache/compat/VERSION, which goes
# first on PYTHONPATH; torch and everything else come from .venv (APBV_PYTHON overrides the
# interpreter). Test targets: tests/unit tests/multirank/test_model_multirank.py unless the
# pytest args name their own.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ ! $1 =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
  echo "usage: bash scripts/compat.sh VERSION [pytest args]   (e.g. 4.57.6)" >&2
  exit 2
fi
version=$1
shift
python=${APBV_PYTHON:-.venv/bin/python}
if [ ! -x "$python" ]; then
  echo "error: $python not found (run bash scripts/bootstrap.sh, or set APBV_PYTHON)" >&2
  exit 2
fi
side=.cache/compat/$version
stamp=$side/.apbv-complete
if [ ! -f "$stamp" ]; then
  rm -rf "$side"
  mkdir -p "$side"
  log=$side/../install-$version.log
  echo "[compat] installing transformers==$version into $side ..." >&2
  if ! "$python" -m pip install --quiet --no-deps --target "$side" \
      "transformers==$version" >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "error: could not install transformers==$version (log: $log)" >&2
    exit 1
  fi
  # Then whatever transformers (and what came with it) requires that the interpreter's own
  # packages do not satisfy: tokenizers and huggingface-hub, and httpx & co. for hub 1.x.
  for _ in 1 2 3 4 5 6; do
    missing=$(PYTHONPATH="$PWD/$side" "$python" - "$PWD/$side" <<'EOF'
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

for dist in metadata.distributions(path=[sys.argv[1]]):
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            print(f"{name}{req.specifier}")
EOF
    )
    [ -z "$missing" ] && break
    missing=$(echo "$missing" | sort -u)
    echo "[compat] also installing: $(echo "$missing" | tr '\n' ' ')" >&2
    # shellcheck disable=SC2086  # one requirement per word
    if ! "$python" -m pip install --quiet --no-deps --target "$side" $missing >>"$log" 2>&1
    then
      tail -n 20 "$log" >&2
      echo "error: could not install $missing (log: $log)" >&2
      exit 1
    fi
  done
  touch "$stamp"
fi
targets=0  # pytest arguments that name a test file or directory replace the default ones
for arg in "$@"; do
  [ -e "${arg%%::*}" ] && targets=1
done
if [ "$targets" = 0 ]; then
  set -- tests/unit tests/multirank/test_model_multirank.py "$@"
fi
export PYTHONPATH="$PWD/$side:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c 'import tokenizers, huggingface_hub, transformers
print(f"[compat] transformers {transformers.__version__} from {transformers.__file__}")
print(f"[compat] tokenizers {tokenizers.__version__},",
      f"huggingface-hub {huggingface_hub.__version__}")'
exec "$python" -m pytest -p no:cacheprovider "$@"
