"""Ray on one machine (`structserve serve`, the end-to-end tests), closed to the network.

Ray binds its GCS, raylet, workers and agents to every interface unless the node's address is
loopback, and on Linux it swaps a loopback `--node-ip-address` for the host's own address. With
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` it keeps 127.0.0.1 (the mode Ray uses on a laptop), and
every listener of Ray's own follows it. Serve's replicas still start their inter-deployment gRPC
server on `[::]`: `keep_replicas_on_loopback` moves it to the node's loopback address when the
node is loopback. Token auth is on as well (a token made for this run, unless one is set): any
other user of the machine reaches loopback too, and the dashboard agent's job route runs code.
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any

SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def environment() -> bool:
    """The environment Ray reads for both: before `ray` is first imported (it reads its auth
    mode then) and before it starts (its processes, and the replicas they start, inherit it).
    True when it changed anything."""
    before = dict(os.environ)
    os.environ[SINGLE_MACHINE] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and not os.environ.get("RAY_AUTH_TOKEN"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return dict(os.environ) != before


def start(**init_kwargs: Any) -> None:
    """`ray.init` for one machine: every Ray listener on loopback, token auth on."""
    if environment() and "ray" in sys.modules:  # it would not send the token it starts with
        raise RuntimeError("call deployments.local_ray.environment() before importing ray")
    import ray

    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("configure_logging", False)
    ray.init(**init_kwargs)


def keep_replicas_on_loopback() -> None:
    """In a Serve replica's process on a loopback node: its inter-deployment gRPC server binds
    the node's address instead of `[::]` (called on import of our deployments; a no-op
    anywhere else)."""
    replica = sys.modules.get("ray.serve._private.replica")
    if os.environ.get(SINGLE_MACHINE) != "0" or replica is None:
        return
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "loopback", False):
        return

    def on_loopback(server: Any, address: str) -> int:
        port: int = bind(server, "127.0.0.1:0" if address == "[::]:0" else address)
        return port

    on_loopback.loopback = True  # type: ignore[attr-defined]
    setattr(replica, "add_port_to_grpc_server", on_loopback)  # noqa: B010 (a module ray owns)
