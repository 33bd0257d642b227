#!/usr/bin/env bash
# One request on NPROC local ranks: torchrun + python -m apbv generate.
#   NPROC=8 CONFIG=qwen2_5_vl_7b_8gpu launch/generate.sh \
#       --video /data/clip.mp4 --question "What happens?" --set model.path=/ckpt/Qwen2.5-VL-7B-Instruct
# Environment (defaults): NPROC (GPUs on this node, else 2), CONFIG (tiny_cpu), LOG_RANK (0: only
# rank 0's output; "all" for every rank), PYTHON (.venv/bin/python, else python3: the same
# interpreter counts the GPUs and runs the ranks), APBV_DRY_RUN=1 (or DRY_RUN=1) prints the
# command instead of running it. PYTORCH_CUDA_ALLOC_CONF defaults to expandable_segments:True.
# Everything after the script name goes to `python -m apbv generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)') || {
    echo "launch/generate.sh: $PYTHON cannot import torch to count the GPUs; set PYTHON or NPROC" >&2
    exit 1
  }
fi
CONFIG=${CONFIG:-tiny_cpu}
LOG_RANK=${LOG_RANK:-0}
filter=()
[ "$LOG_RANK" != "all" ] && filter=(--local-ranks-filter "$LOG_RANK")
cmd=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "${filter[@]}"
     -m apbv generate --config "$CONFIG" "$@")
if [ "${APBV_DRY_RUN:-${DRY_RUN:-0}}" = "1" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
# The CUDA caching allocator maps memory into growable segments (one KV buffer per layer per
# request, between transients, fragments less); a user's own setting (either name) is kept.
if [ -z "${PYTORCH_CUDA_ALLOC_CONF:-}${PYTORCH_ALLOC_CONF:-}" ]; then
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec "${cmd[@]}"
