"""Ray for ``serve``: a private local cluster, or the operator's cluster joined with its token.

Ray's ports (the GCS, the raylet, the object manager, every worker's gRPC server, the
runtime-env and dashboard agents) run code for whoever can call them, so ``serve`` never turns
Ray's token authentication off (``RAY_AUTH_MODE=token``: every Ray RPC and HTTP endpoint wants
the cluster's token):

- **Local cluster** (no ``--address``; always a new one, whatever ``RAY_ADDRESS`` says or a
  cluster started on this host with ``ray start``): a fresh 256-bit token made at each start
  (``secrets.token_hex(32)``) is put in this process's environment (``RAY_AUTH_TOKEN``), which
  Ray's processes and the rank actors inherit; it is never written to a file, a command line or
  the log. Every Ray port is bound to the loopback address: whatever ``--host`` the HTTP front
  end binds, the cluster is one node in this host, so no other host ever needs to reach it.
  Ray rewrites a loopback ``_node_ip_address`` to the host's routable address unless its
  single-host mode is on (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when ``ray`` is
  imported), which is what makes its servers listen on 127.0.0.1 only; the start is checked
  and refused otherwise. Ray's own memory monitor is off there
  (``RAY_memory_monitor_refresh_ms=0`` unless the variable is set): at 95% of the host's memory,
  whoever uses it, it kills a rank, which only turns memory pressure into a lost replica (every
  request and stream on it fails and the model reloads); the server refuses work by its own
  figures instead, and a rank the kernel kills is a lost rank, rebuilt.
- **``--address`` cluster**: joined in token mode with the operator's token, read by Ray from
  ``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``
  (in that order); the cluster's nodes must have been started with ``RAY_AUTH_MODE=token``
  and the same token. ``RAY_AUTH_MODE=disabled`` is refused.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOOPBACK_IFNAME = "lo"
TOKEN_SOURCES = "RAY_AUTH_TOKEN, a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token"
ENVIRONMENT = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "GLOO_SOCKET_IFNAME",
               "RAY_memory_monitor_refresh_ms")
"""The variables :func:`prepare_ray_env` may set or remove in this process."""

log = logging.getLogger("apbv.serve")


def prepare_ray_env(address: str | None) -> None:
    """Set this process's Ray environment before ``ray`` is imported (Ray's processes and the
    rank actors inherit it): token mode always; for a local cluster a new token, Ray's
    single-host mode, its memory monitor off and gloo on the loopback interface (unless
    RAY_memory_monitor_refresh_ms or GLOO_SOCKET_IFNAME is set);
    for ``address`` check that a token is at hand. Raises ValueError naming the variable at
    fault."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if address is None:
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # see the module docstring
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                          RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        if LOOPBACK_IFNAME in (name for _, name in socket.if_nameindex()):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)  # the ranks' gloo
        return
    if mode is not None and mode.lower() != "token":
        raise ValueError(f"RAY_AUTH_MODE={mode}: --address joins a Ray cluster only with token "
                         "authentication; unset it or set RAY_AUTH_MODE=token, start the "
                         f"cluster's nodes with it, and give the cluster's token in "
                         f"{TOKEN_SOURCES}")
    if not os.environ.get("RAY_AUTH_TOKEN"):
        path = os.environ.get("RAY_AUTH_TOKEN_PATH")
        token_file = Path(path) if path else Path.home() / ".ray" / "auth_token"
        try:
            found = bool(token_file.read_text().strip())
        except OSError:
            found = False
        if not found:
            raise ValueError(f"--address {address}: no Ray authentication token (looked in "
                             f"{TOKEN_SOURCES}; {token_file} is missing, unreadable or empty)")
    os.environ["RAY_AUTH_MODE"] = "token"


def init_ray(address: str | None, num_cpus: int) -> str:
    """Start the local cluster (``num_cpus`` CPUs, all its ports on loopback) or join
    ``address``, after :func:`prepare_ray_env`; returns the GCS address (``host:port``)."""
    import ray

    if address is not None:
        ctx = ray.init(address=address, log_to_driver=True)
        # ray.init returns a RayContext, annotated as its base class
        gcs = ctx.address_info["gcs_address"]  # type: ignore[attr-defined]
        log.info("Ray: joined the cluster at %s (token authentication)", gcs)
        return gcs
    # "local": a new cluster, never one named by RAY_ADDRESS or left running on this host
    ctx = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                   log_to_driver=True, object_store_memory=128 << 20, _node_ip_address=LOOPBACK)
    info = ctx.address_info  # type: ignore[attr-defined]  # a RayContext, as above
    if info["node_ip_address"] != LOOPBACK:  # ray was imported before prepare_ray_env
        ray.shutdown()
        raise RuntimeError(f"the local Ray cluster came up on {info['node_ip_address']}, "
                           f"not {LOOPBACK}: prepare_ray_env must run before ray is imported")
    log.info("Ray: local cluster at %s (token authentication, ports on %s only)",
             info["gcs_address"], LOOPBACK)
    return info["gcs_address"]
