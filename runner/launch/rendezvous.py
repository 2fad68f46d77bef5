"""The c10d rendezvous of a multi-node launch: its settings, and its failures in one line.

torch's elastic rendezvous has its own timeouts (join 600 s, store reads 60 s) and, when
the endpoint never answers, retries for minutes while printing C++ stack traces. Here
both timeouts follow launch.rdzv_timeout, and every way of not meeting is one UserError
naming the endpoint and that setting.
"""

from __future__ import annotations

import socket
import time
from typing import Optional

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from runner.config.errors import UserError
from runner.config.spec import LaunchSpec


def rendezvous_configs(launch: LaunchSpec) -> dict[str, object]:
    """The c10d rendezvous settings of a multi-node launch.

    torch's defaults (join 600 s, store reads 60 s) are not the user's to see, and a node
    tokenizes before it joins: both timeouts follow launch.rdzv_timeout instead. The
    read timeout also bounds how long a node waits for the endpoint to answer at all.
    """
    return {
        "is_host": launch.node_rank == 0,  # node 0 hosts the rendezvous store; the others connect
        "join_timeout": launch.rdzv_timeout,
        "read_timeout": launch.rdzv_timeout,
    }


def check_endpoint(launch: LaunchSpec, endpoint: str) -> None:
    """Fail fast, in one line, where torch would retry for minutes and print C++ stack traces.

    Node 0 must be able to listen at the endpoint (it hosts the store there); every other
    node waits, at most launch.rdzv_timeout seconds, for the endpoint to accept connections.
    """
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    try:
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise UserError(
            f"launch.rdzv_endpoint={endpoint}: the host {host!r} does not resolve on this machine ({err.strerror}). "
            "Give node 0's IP address, or a name every node resolves."
        ) from None
    if launch.node_rank == 0:
        with socket.socket(address[0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address[4])
            except OSError as err:
                raise UserError(
                    f"launch.rdzv_endpoint={endpoint}: node 0 hosts the rendezvous there but cannot listen on it "
                    f"({err.strerror}). Give an address of node 0 itself and a free port."
                ) from None
        return
    deadline = time.monotonic() + launch.rdzv_timeout
    for _ in range(launch.rdzv_timeout + 1):  # about one try a second
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 5.0)):
                return
        except OSError:
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
    raise UserError(rendezvous_failure(launch, endpoint, None))


def rendezvous_failure(launch: LaunchSpec, endpoint: str, err: Optional[Exception]) -> str:
    """One line for a rendezvous that failed (err None: the endpoint never answered)."""
    if err is None or isinstance(err, RendezvousConnectionError):
        what = f"nothing answered at launch.rdzv_endpoint={endpoint}"
    elif isinstance(err, RendezvousTimeoutError):
        what = f"not all {launch.nnodes} nodes joined the rendezvous at launch.rdzv_endpoint={endpoint}"
    else:
        what = f"the rendezvous at launch.rdzv_endpoint={endpoint} failed ({type(err).__name__})"
    return (
        f"{what} within launch.rdzv_timeout={launch.rdzv_timeout} s. Start every node with the same "
        "launch.rdzv_endpoint (node 0's address, reachable from every node) and launch.nnodes, "
        "or raise launch.rdzv_timeout if a node starts later than that."
    )
