"""Starting local process groups (demos, the report, tests): a free rendezvous port on this machine."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for ``MASTER_PORT`` of spawned local ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
