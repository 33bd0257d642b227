"""The real server's Ray cluster is private (one start of ``python -m apbv serve --world-size 2``
on ``--host 127.0.0.1``): a Ray driver without the cluster's token, or with a wrong one, is
refused by the GCS and runs nothing, while the same probe with the token runs its task (so the
probe does reach the cluster); no TCP port of the server's processes (the driver, Ray's GCS,
raylet and agents, the rank actors) listens on anything but loopback; the token is in no
command line, not in the server's log and not in Ray's logs of the cluster."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from tests.serve.server import ROOT, ServerProcess  # noqa: E402

PROBE = """
import os, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
@ray.remote(num_cpus=0)
def touch(path):
    open(path, "w").write(str(os.getpid()))
ray.get(touch.remote(sys.argv[2]), timeout=60)
print("ran the task")
"""
REFUSED = "Authentication token is missing or incorrect"
TCP_LISTEN, UDP_UNCONNECTED = "0A", "07"


def _session_pids(sid: int) -> list[int]:
    """The processes of session ``sid``: the server and everything Ray started for it."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                pids.append(int(pid))
        except OSError:  # ended while we looked
            continue
    return pids


def _cluster_token(sid: int) -> str | None:
    """The RAY_AUTH_TOKEN that Ray's processes of the server were started with (their
    environment, readable by their own user only); None if they have none."""
    tokens = set()
    for pid in _session_pids(sid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        tokens.update(e.split(b"=", 1)[1].decode() for e in env
                      if e.startswith(b"RAY_AUTH_TOKEN="))
    assert len(tokens) <= 1, "the server's Ray processes hold different tokens"
    return tokens.pop() if tokens else None


def _probe(gcs: str, marker: Path, **env: str) -> subprocess.CompletedProcess:
    """A Ray driver that joins ``gcs`` and runs one task writing ``marker``; Ray's single-host
    mode keeps a 127.0.0.1 address as it is, and the GCS connect gives up after ~3 s."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    full.update(PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                RAY_gcs_server_port_wait_time_s="3", **env)
    return subprocess.run([sys.executable, "-c", PROBE, gcs, str(marker)], env=full,
                          capture_output=True, text=True, timeout=120)


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s local address (32-bit words in host byte order) as text."""
    host, port = hex_addr.split(":")
    raw = b"".join(struct.pack("=I", int(host[i:i + 8], 16)) for i in range(0, len(host), 8))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _listening_sockets(sid: int) -> list[tuple[int, str, str]]:
    """(pid, command, local address) of each listening TCP socket and unconnected UDP socket
    held by a process of session ``sid`` (the server and everything Ray started for it)."""
    by_inode: dict[str, str] = {}
    for table, state in (("tcp", TCP_LISTEN), ("tcp6", TCP_LISTEN), ("udp", UDP_UNCONNECTED),
                         ("udp6", UDP_UNCONNECTED)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == state:
                by_inode[fields[9]] = f"{table} {_address(fields[1])}"
    found = []
    for pid in _session_pids(sid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in by_inode:
                    found.append((pid, command[:120], by_inode[target[8:-1]]))
        except OSError:  # a process that ended while we looked
            continue
    return found


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    """(the server process, its Ray GCS address from its start log); it is started with
    RAY_ADDRESS naming another cluster, which a server without --address must not join."""
    with pytest.MonkeyPatch.context() as env:  # the process takes os.environ as it starts
        env.setenv("RAY_ADDRESS", "127.0.0.1:1")
        srv = ServerProcess(tiny_model_dir, "--world-size", "2", "--host", "127.0.0.1")
    try:
        srv.wait_ready(timeout_s=240)
        found = re.search(r"Ray: local cluster at (\S+) ", "".join(srv.log))
        assert found, "no Ray address in the server's log:\n" + srv.tail()
        yield srv, found.group(1)
    finally:
        srv.stop()


def test_a_driver_without_the_token_cannot_submit_work(server, tmp_path: Path):
    srv, gcs = server
    token = _cluster_token(srv.proc.pid)
    probes = {"no token (auth disabled)": {"RAY_AUTH_MODE": "disabled"},
              "no token (auth unset)": {},
              "a wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}}
    if token is not None:  # the probe itself works: with the token it reaches the cluster
        probes["the token"] = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    with ThreadPoolExecutor(len(probes)) as pool:
        runs = {name: pool.submit(_probe, gcs, tmp_path / f"{i}.ran", **env)
                for i, (name, env) in enumerate(probes.items())}
        results = {name: (run.result(), tmp_path / f"{i}.ran")
                   for i, (name, run) in enumerate(runs.items())}
    for name, (done, marker) in results.items():
        out = (done.stdout + done.stderr)[-3000:]
        if name != "the token":
            assert done.returncode != 0 and not marker.exists(), f"{name}: the task ran\n{out}"
            assert REFUSED in out, f"{name}: not refused by the GCS\n{out}"
    assert token is not None and len(token) == 64, "no 256-bit RAY_AUTH_TOKEN in Ray's processes"
    done, marker = results["the token"]
    assert done.returncode == 0 and marker.exists(), (done.stdout + done.stderr)[-3000:]
    session_dirs = set()
    for pid in _session_pids(srv.proc.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert token.encode() not in command, f"the token on the command line of {pid}"
        session_dirs.update(re.findall(rb"--session-dir=([^\0 ]+)", command))
    assert token not in "".join(srv.log)
    assert len(session_dirs) == 1, session_dirs  # Ray's own logs of this cluster
    logs = [f for f in Path(session_dirs.pop().decode(), "logs").rglob("*") if f.is_file()]
    assert logs and not [f for f in logs if token.encode() in f.read_bytes()]


def test_no_port_listens_beyond_loopback(server):
    srv, gcs = server
    found = _listening_sockets(srv.proc.pid)
    gcs_port = gcs.rsplit(":", 1)[1]
    assert any(address.rsplit(":", 1)[1] == gcs_port for _, _, address in found), \
        f"the GCS port {gcs} is not among the server's sockets: {found}"
    open_ = [(pid, command, address) for pid, command, address in found
             if not _is_loopback(address.split()[1])]
    assert not open_, "listening beyond loopback:\n" + "\n".join(map(str, open_))


@pytest.fixture
def ray_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """A clean Ray environment (no RAY_* variables, HOME without a token file); what
    prepare_ray_env sets is undone afterwards."""
    from apbv.serve.ranks.ray_cluster import ENVIRONMENT as touched

    for name in {*touched, *(n for n in os.environ if n.startswith("RAY_"))}:
        monkeypatch.setenv(name, "")  # recorded, so the undo restores (or removes) it
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    return monkeypatch


def test_a_local_cluster_gets_a_new_token_and_loopback_every_start(ray_env):
    from apbv.serve.ranks.ray_cluster import prepare_ray_env

    ray_env.setenv("RAY_AUTH_MODE", "disabled")
    ray_env.setenv("RAY_AUTH_TOKEN_PATH", "/nonexistent")
    prepare_ray_env(None)
    first = os.environ["RAY_AUTH_TOKEN"]
    assert os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN_PATH" not in os.environ
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["RAY_memory_monitor_refresh_ms"] == "0"  # Ray's OOM killer off
    assert re.fullmatch("[0-9a-f]{64}", first)
    ray_env.setenv("RAY_memory_monitor_refresh_ms", "250")  # the operator's choice is kept
    prepare_ray_env(None)
    assert os.environ["RAY_AUTH_TOKEN"] != first
    assert os.environ["RAY_memory_monitor_refresh_ms"] == "250"


def test_joining_a_cluster_needs_token_auth_and_a_token(ray_env, tmp_path: Path):
    from apbv.serve.ranks.ray_cluster import prepare_ray_env

    ray_env.setenv("RAY_AUTH_TOKEN", "a" * 64)
    ray_env.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE=disabled: --address joins"):
        prepare_ray_env("10.0.0.1:6379")
    ray_env.delenv("RAY_AUTH_MODE")
    prepare_ray_env("10.0.0.1:6379")  # the operator's token; token mode is set for Ray
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN"] == "a" * 64
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    assert "RAY_memory_monitor_refresh_ms" not in os.environ  # the operator's cluster's own
    ray_env.delenv("RAY_AUTH_TOKEN")
    with pytest.raises(ValueError, match="no Ray authentication token .*RAY_AUTH_TOKEN_PATH"):
        prepare_ray_env("10.0.0.1:6379")
    ray_env.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "empty"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        prepare_ray_env("10.0.0.1:6379")
    ray_env.delenv("RAY_AUTH_TOKEN_PATH")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("b" * 64)
    prepare_ray_env("10.0.0.1:6379")  # Ray's default token file
