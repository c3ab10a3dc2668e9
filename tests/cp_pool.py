"""A persistent pool of gloo ranks for the context-parallel tests.

Starting processes costs seconds on a small CPU, so the tests start ``world`` ranks once (a free port, processes
from :func:`csattn.cp.launch.rank_context`), create one process group per CP size (ranks ``0 .. P-1``), and send
them tasks through queues.
Every task result comes back per rank; a rank that does not answer in time fails the test and the pool is torn
down, so a hang can never block the suite. "In time" is derived from pytest's timeout of the running test
(``pytest-timeout``: its ``timeout`` marker, else ``--timeout``; conftest calls :func:`set_test_deadline`): the
pool gives up a margin before pytest would kill the test, so the failure names the hang instead of dumping
stacks.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from datetime import timedelta

import torch

from csattn.cp.launch import free_port, process, rank_context

FALLBACK_WAIT_S = 360.0  # a rank's answer, where pytest sets no timeout
_DEADLINE: tuple[float, float] | None = None  # (monotonic deadline, the test's whole timeout) of the running test


def set_test_deadline(timeout_s: float | None) -> None:
    """Called as each test starts with its pytest timeout (None or 0: none)."""
    global _DEADLINE
    _DEADLINE = (time.monotonic() + timeout_s, timeout_s) if timeout_s else None


def wait_s(cap: float | None = None) -> float:
    """How long a rank's answer may take now: until a margin (a tenth of the test's timeout, at most 30 s) before
    the running test's pytest deadline, at most ``cap``; ``cap`` or :data:`FALLBACK_WAIT_S` without a deadline."""
    if _DEADLINE is None:
        return cap or FALLBACK_WAIT_S
    deadline, total = _DEADLINE
    left = max(1.0, deadline - time.monotonic() - min(30.0, 0.1 * total))
    return min(cap, left) if cap else left


def _worker(rank: int, world: int, port: int, tasks, results, pg_timeout_s: float = 240.0) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    # Generous limits: they catch hangs, not slowness. A Triton-interpreter task takes about a minute alone and
    # twice that on a 2-core machine running another test worker beside it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout_s))
    groups = {p: dist.new_group(list(range(p)), timeout=timedelta(seconds=pg_timeout_s)) for p in range(1, world + 1)}
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, size, kwargs = item
        if rank >= size:
            results.put((rank, "idle", None))
            continue
        try:
            out = fn(groups[size], **kwargs)
            results.put((rank, "ok", out))
        except Exception as err:  # report, keep serving
            results.put((rank, "error", (type(err).__name__, str(err), traceback.format_exc())))
    dist.destroy_process_group()


class RankPool:
    """``world`` gloo ranks serving tasks ``fn(group, **kwargs)`` on the first ``size`` of them."""

    def __init__(self, world: int = 4, timeout: float | None = None, pg_timeout_s: float = 240.0) -> None:
        # timeout: the most a rank's answer may take (None: until shortly before pytest's deadline, wait_s);
        # pg_timeout_s: the process groups' collective timeout; a short one turns a hang into a rank error
        self.world, self.timeout = world, timeout
        ctx = rank_context()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [process(_worker, r, world, port, self.tasks[r], self.results, pg_timeout_s, daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, size: int, **kwargs) -> list:
        """Run on ranks ``0 .. size-1``; returns per-rank ``("ok", value)`` or ``("error", (type, msg, tb))``."""
        for q in self.tasks:
            q.put((fn, size, kwargs))
        out: list = [None] * self.world
        for _ in range(self.world):
            wait = wait_s(self.timeout)
            try:
                rank, status, value = self.results.get(timeout=wait)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(f"a CP rank did not answer within {wait:.0f} s (hang?)") from None
            out[rank] = (status, value)
        return out[:size]

    def run_ok(self, fn, size: int, **kwargs) -> list:
        """Like :meth:`run`, raising the first rank error (with its traceback)."""
        res = self.run(fn, size, **kwargs)
        for status, value in res:
            if status == "error":
                raise AssertionError(f"rank failed: {value[0]}: {value[1]}\n{value[2]}")
        return [v for _, v in res]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()


_SHARED: RankPool | None = None


def shared_pool(world: int = 4) -> RankPool:
    """One pool per test process, closed at exit."""
    global _SHARED
    if _SHARED is None or any(not p.is_alive() for p in _SHARED.procs):
        import atexit

        _SHARED = RankPool(world)
        atexit.register(_SHARED.close)
    return _SHARED
