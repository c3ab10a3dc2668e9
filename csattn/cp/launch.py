"""Starting local process groups (demos, the report, tests): a free rendezvous port on this machine, and the ranks
themselves, started on a CPU-only machine from a fork server that has imported what a rank needs once.

A spawned process imports torch, csattn and, on its first training step, ``torch._dynamo`` (torch's optimizers
and ``nn.init`` reach it): about 5 s of CPU a rank on a small machine, so 4 ranks of a tiny model took 14 s where
their training took 0.3. Forked from a server that imported those modules, a rank starts in a fraction of a
second (3.5 s for the same run). The server is made once per process, with the environment and the standard output
of that moment, so each rank takes its caller's environment, stdout and stderr before it runs, as a
spawned one would.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "process", "rank_context", "start_ranks"]

# what a rank imports: torch itself, torch._dynamo (reached lazily from torch's optimizers and initializers), and
# csattn's training, sharding and CP code
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "csattn.train.run", "csattn.parallel",
           "csattn.cp", "csattn.finetune")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for ``MASTER_PORT`` of spawned local ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context that local ranks start from: on Linux with no GPU visible, ``forkserver`` with
    :data:`PRELOAD` imported in the server; else ``spawn``. Start processes with :func:`process` or
    :func:`start_ranks` (they hand each its caller's environment and stdio); the context serves for queues and values.

    With a GPU, ranks are spawned as before: a forked rank cannot use CUDA once its server has initialized it, and
    whether some import of a CUDA build of torch does that is not checked here (the CPU's gain is the point). macOS
    spawns too: a process forked after its system frameworks loaded may crash there (Python's own default)."""
    import torch
    import torch.multiprocessing as mp

    forkserver = sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods()
    if not forkserver or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first use); later calls change nothing
    return ctx


class _CallerStdio:
    """The starting process's stdout and stderr, handed to a rank as file descriptors when it is pickled for the
    start (a forked rank's own are the fork server's, which may be another file: a test's captured output)."""

    def __init__(self, fds: tuple | None = None) -> None:
        self.fds = fds

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _CallerStdio, ((DupFd(1), DupFd(2)),)

    def take(self) -> None:
        """In the rank: make the caller's descriptors this process's 1 and 2."""
        if self.fds is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for target, dup in zip((1, 2), self.fds, strict=True):
            fd = dup.detach()
            if fd != target:  # spawn passes the descriptor under its own number
                os.dup2(fd, target)
                os.close(fd)


def _in_env(env: dict[str, str], stdio: _CallerStdio, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in this process with ``env`` as its whole environment and ``stdio`` as its stdout and
    stderr: a forked rank has the server's, not its caller's."""
    os.environ.clear()
    os.environ.update(env)
    stdio.take()
    return fn(*args)


def _caller() -> tuple[dict[str, str], _CallerStdio]:
    """The first two arguments of :func:`_in_env` for a process started from here."""
    return dict(os.environ), _CallerStdio()


def _rank_in_env(rank: int, env: dict[str, str], stdio: _CallerStdio, fn: Callable[..., Any], *args: Any) -> Any:
    return _in_env(env, stdio, fn, rank, *args)


def process(fn: Callable[..., Any], *args: Any, daemon: bool = False) -> multiprocessing.process.BaseProcess:
    """An unstarted process of :func:`rank_context` that runs ``fn(*args)`` with this process's environment, stdout
    and stderr of now. ``fn`` and ``args`` must pickle."""
    return rank_context().Process(target=_in_env, args=(*_caller(), fn, *args), daemon=daemon)


def start_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` on ``nprocs`` local processes from :func:`rank_context`, joined; a rank's exception is
    raised here (``torch.multiprocessing.ProcessRaisedException``). ``fn`` and ``args`` must pickle."""
    import torch.multiprocessing as mp

    ctx = rank_context()
    mp.start_processes(_rank_in_env, args=(*_caller(), fn, *args), nprocs=nprocs,
                       start_method=ctx.get_start_method())
