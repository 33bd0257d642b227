"""The launch scripts: every one parses (``bash -n``), and their dry runs (APBV_DRY_RUN=1) print
the commands they would run: the venv's python and torchrun, the head node's IP address and a
rendezvous port derived from the job id. Slurm's commands are fakes put on PATH."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("launch/*.sh"), *ROOT.glob("scripts/*.sh"),
                  *ROOT.glob("slurm/*.sbatch"), *ROOT.glob("slurm/*.sh")])

FAKES = {
    # the job's nodes
    "scontrol": '[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n"',
    # srun: drop its options, run the command on "the node"
    "srun": 'while [ $# -gt 0 ]; do case $1 in -w) shift 2;; -*) shift;; *) break;; esac; done\n'
            'exec "$@"',
    "hostname": '[ "$1" = "-I" ] && echo "10.8.0.17 172.17.0.1 fe80::1" || echo gpu-a17',
}


def _write(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_cluster(tmp_path):
    """(env, venv): fake Slurm commands first on PATH, a fake venv, a Slurm job's variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        _write(bin_dir / name, body)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "torchrun", "ray"):
        _write(venv / "bin" / tool, "exit 3")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", APBV_DRY_RUN="1",
               SLURM_JOB_ID="123456", SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_NNODES="2",
               SLURM_CPUS_PER_TASK="32", SLURM_SUBMIT_DIR=str(ROOT), VENV=str(venv))
    return env, venv


def _dry_run(script: str, env: dict, *args: str, cwd: Path) -> list[list[str]]:
    out = subprocess.run(["bash", str(ROOT / script), *args], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_parses(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_generate_counts_gpus_with_the_python_that_runs_the_job(tmp_path):
    python = _write(tmp_path / "python", '[ "$1" = "-c" ] && echo 3')  # "3 GPUs"
    env = dict(os.environ, PYTHON=str(python), APBV_DRY_RUN="1")
    env.pop("NPROC", None)
    [cmd] = _dry_run("launch/generate.sh", env, "--video", "clip one.mp4", cwd=tmp_path)
    assert cmd[:6] == [str(python), "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node", "3"], cmd
    assert cmd[-2:] == ["--video", "clip one.mp4"]


def test_generate_refuses_a_python_without_torch(tmp_path):
    python = _write(tmp_path / "python", "exit 1")
    env = dict(os.environ, PYTHON=str(python), APBV_DRY_RUN="1")
    env.pop("NPROC", None)
    out = subprocess.run(["bash", str(ROOT / "launch/generate.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "cannot import torch" in out.stderr, out


@pytest.mark.parametrize("script,verb", [("slurm/generate_1node.sbatch", "generate"),
                                         ("slurm/generate_2node.sbatch", "generate"),
                                         ("slurm/eval_1node.sbatch", "eval"),
                                         ("slurm/batch_1node.sbatch", "batch")])
def test_torchrun_jobs_use_the_venv_the_head_ip_and_a_port_per_job(fake_cluster, tmp_path,
                                                                    script, verb):
    env, venv = fake_cluster
    [cmd] = _dry_run(script, env, "--question", "What happens?", cwd=tmp_path)
    assert cmd[:2] == ["srun", str(venv / "bin" / "torchrun")], cmd
    endpoint = cmd[cmd.index("--rdzv_endpoint") + 1]
    assert endpoint == f"10.8.0.17:{20000 + 123456 % 20000}", cmd
    assert cmd[cmd.index("--rdzv_id") + 1] == "123456"
    assert cmd[cmd.index("-m") + 1:cmd.index("-m") + 3] == ["apbv", verb]
    assert cmd[-2:] == ["--question", "What happens?"]
    other = dict(env, SLURM_JOB_ID="123457")
    [again] = _dry_run(script, other, cwd=tmp_path)
    assert again[again.index("--rdzv_endpoint") + 1] == "10.8.0.17:23457"


def test_serve_starts_the_venvs_ray_and_server_on_the_head_ip(fake_cluster, tmp_path):
    env, venv = fake_cluster
    lines = _dry_run("slurm/serve.sbatch", env, "--model", "/ckpt/m", cwd=tmp_path)
    ray_starts = [c for c in lines if c[:1] == ["srun"]]
    assert len(ray_starts) == 2, lines  # the head, and the one other node
    for c in ray_starts:
        assert c[c.index("-w") + 2:c.index("-w") + 4] == [str(venv / "bin" / "ray"), "start"], c
    head = next(c for c in ray_starts if "--head" in c)
    assert "--node-ip-address=10.8.0.17" in head and "gpu-a17" in head
    worker = next(c for c in ray_starts if "--head" not in c)
    assert "--address=10.8.0.17:6379" in worker and "gpu-a18" in worker
    [serve] = [c for c in lines if c[:1] == [str(venv / "bin" / "python")]]
    assert serve[1:4] == ["-m", "apbv", "serve"]
    assert serve[serve.index("--address") + 1] == "10.8.0.17:6379"
    assert serve[serve.index("--world-size") + 1] == "16"


ALLOC_CASES = [({}, "expandable_segments:True|"),
               ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
                "backend:cudaMallocAsync|"),
               ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
                "|expandable_segments:False")]
SHOW_ALLOC = 'echo "${PYTORCH_CUDA_ALLOC_CONF:-}|${PYTORCH_ALLOC_CONF:-}"'


def _without_alloc_conf(env: dict) -> dict:
    return {k: v for k, v in env.items()
            if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "APBV_DRY_RUN",
                         "DRY_RUN")}


@pytest.mark.parametrize("user, seen", ALLOC_CASES)
def test_generate_ranks_get_expandable_segments_unless_set(tmp_path, user, seen):
    python = _write(tmp_path / "python", SHOW_ALLOC)  # stands in for torchrun's python
    env = dict(_without_alloc_conf(os.environ), PYTHON=str(python), NPROC="2", **user)
    out = subprocess.run(["bash", str(ROOT / "launch/generate.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == seen, out


@pytest.mark.parametrize("user, seen", ALLOC_CASES)
def test_slurm_jobs_get_expandable_segments_unless_set(fake_cluster, tmp_path, user, seen):
    env, venv = fake_cluster
    _write(venv / "bin" / "torchrun", SHOW_ALLOC)
    env = dict(_without_alloc_conf(env), **user)
    for script in ("generate_1node", "generate_2node", "eval_1node", "batch_1node"):
        out = subprocess.run(["bash", str(ROOT / f"slurm/{script}.sbatch")], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == seen, (script, out)
    # serve.sbatch's Ray nodes (and so its rank actors) take the same common.sh first.
    for sbatch in ROOT.glob("slurm/*.sbatch"):
        first_run = sbatch.read_text().index("\nrun ")
        assert "/slurm/common.sh\"" in sbatch.read_text()[:first_run], sbatch.name


def test_eval_array_runs_its_shard_into_its_own_output(fake_cluster, tmp_path):
    env, venv = fake_cluster
    env = dict(env, SLURM_ARRAY_TASK_ID="2", SLURM_ARRAY_TASK_MIN="0",
               SLURM_ARRAY_TASK_COUNT="8", SLURM_NNODES="1", OUT="results/lvb", EVAL_GROUPS="4")
    [cmd] = _dry_run("slurm/eval_array.sbatch", env, "--bench", "longvideobench", cwd=tmp_path)
    assert cmd[:2] == ["srun", str(venv / "bin" / "torchrun")], cmd
    assert cmd[cmd.index("-m") + 1:cmd.index("-m") + 3] == ["apbv", "eval"]
    assert cmd[cmd.index("--shard") + 1] == "3/8"
    assert cmd[cmd.index("--groups") + 1] == "4"
    assert cmd[cmd.index("--out") + 1] == "results/lvb.shard3of8.jsonl"
    assert cmd[-2:] == ["--bench", "longvideobench"]
    env.pop("OUT")
    out = subprocess.run(["bash", str(ROOT / "slurm/eval_array.sbatch")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "set OUT" in out.stderr, out
