# Sourced by the slurm/*.sbatch scripts (sbatch runs a copy of the script, so it is found in
# the submit directory: submit from the repository root). Defines:
#   APBV_ROOT  the repository (default: $SLURM_SUBMIT_DIR)
#   VENV       its virtual environment (default: $APBV_ROOT/.venv); PYTHON, TORCHRUN, RAY in it
#   RDZV_PORT  the rendezvous port of this job: 20000 + SLURM_JOB_ID mod 20000 (two jobs that
#              share a head node do not collide; APBV_RDZV_PORT overrides)
#   head_node, head_ip  the first node of the job and its IP address (the rendezvous host:
#              a hostname may resolve to another interface, or not at all, on other nodes)
#   PYTORCH_CUDA_ALLOC_CONF  expandable_segments:True unless it or PYTORCH_ALLOC_CONF is set
#   run CMD... runs CMD, or with APBV_DRY_RUN=1 prints it (shell-quoted) instead; a dry run's
#              `run sleep N` waits for the commands started in the background to print theirs.
APBV_ROOT=${APBV_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
VENV=${VENV:-$APBV_ROOT/.venv}
PYTHON=$VENV/bin/python
TORCHRUN=$VENV/bin/torchrun
RAY=$VENV/bin/ray
RDZV_PORT=${APBV_RDZV_PORT:-$((20000 + ${SLURM_JOB_ID:?run under sbatch (SLURM_JOB_ID)} % 20000))}
mapfile -t job_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")  # no `| head`: SIGPIPE
head_node=${job_nodes[0]:?scontrol listed no node for SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname -I | awk '{print $1}')
if [ -z "$head_ip" ]; then
  echo "apbv: no IP address for the head node $head_node (hostname -I printed none)" >&2
  exit 1
fi
if [ "${APBV_DRY_RUN:-0}" != 1 ] && [ ! -x "$PYTHON" ]; then
  echo "apbv: no virtual environment at $VENV (set VENV, or submit from the repository root)" >&2
  exit 1
fi
export PYTHONPATH="$APBV_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The CUDA caching allocator maps memory into growable segments (one KV buffer per layer per
# request, between transients, fragments less); a user's own setting (either name) is kept.
if [ -z "${PYTORCH_CUDA_ALLOC_CONF:-}${PYTORCH_ALLOC_CONF:-}" ]; then
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi
cd "$APBV_ROOT"

run() {
  if [ "${APBV_DRY_RUN:-0}" = 1 ]; then
    local line
    line=$(printf '%q ' "$@")
    echo "$line"  # one write per command: background jobs print whole lines
    if [ "$1" = sleep ]; then wait; fi
  else
    "$@"
  fi
}
