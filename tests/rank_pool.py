"""Ranks for multi-process tests, started once per test session and reused.

``torch.multiprocessing.spawn`` starts fresh interpreters for every call, and each one imports
torch and rcdl again, which costs more than most of these tests' work. The tests that only need
*some* ranks — not fresh ones — run on :func:`run_ranks` instead: up to :data:`MAX_WORLD`
spawned processes that wait for work, run ``fn(rank, *args)`` together, and stay for the next
test. Each rank starts a task with no process group and leaves none behind (it destroys one its
function left), and its environment variables, thread count and default dtype are restored
after every task, so a test sees what a freshly spawned rank sees (imports aside). Tests that
kill ranks, or that test start-up itself, still spawn their own.

A task that fails on any rank raises :class:`RankFailed` with that rank's traceback; one
that does not finish within ``timeout`` seconds kills the ranks (the next call starts new
ones) and raises ``TimeoutError``.
"""

from __future__ import annotations

import atexit
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

MAX_WORLD = 3


class RankFailed(RuntimeError):
    """A rank's function raised; the message holds the rank and its traceback."""


def _serve(conn: Connection) -> None:
    """A rank's loop: receive ``(fn, rank, args)``, run it, send back what happened."""
    import torch
    import torch.distributed as dist

    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the test session ended
            return
        fn, rank, args = task
        environ = dict(os.environ)
        try:
            fn(rank, *args)
            reply: tuple[str, str] = ("ok", "")
        except BaseException:  # noqa: BLE001 - reported to the test, which decides
            reply = ("failed", traceback.format_exc())
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)
            torch.set_default_dtype(dtype)
        conn.send(reply)


class _Pool:
    def __init__(self) -> None:
        self._ranks: list[tuple[Any, Connection]] = []

    def _ensure(self, world: int) -> None:
        context = mp.get_context("spawn")
        while len(self._ranks) < world:
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs,), daemon=True)
            process.start()
            theirs.close()
            self._ranks.append((process, ours))

    def close(self) -> None:
        for process, conn in self._ranks:
            conn.close()
            process.kill()
            process.join(5)
        self._ranks = []

    def run(self, fn: Callable[..., None], args: tuple, world: int, timeout: float) -> None:
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world size must be in 1..{MAX_WORLD}, got {world}")
        self._ensure(world)
        ranks = self._ranks[:world]
        for rank, (_, conn) in enumerate(ranks):
            conn.send((fn, rank, args))
        replies: dict[int, tuple[str, str]] = {}
        waiting = {conn: rank for rank, (_, conn) in enumerate(ranks)}
        while waiting:
            ready = wait(list(waiting), timeout)
            if not ready:
                self.close()
                raise TimeoutError(f"ranks {sorted(waiting.values())} of {world} did not "
                                   f"finish {fn.__name__} within {timeout:g} s")
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    replies[rank] = conn.recv()
                except EOFError:
                    self.close()
                    raise RankFailed(f"rank {rank} died running {fn.__name__}") from None
        failed = [(rank, text) for rank, (status, text) in sorted(replies.items())
                  if status != "ok"]
        if failed:
            rank, text = failed[0]
            raise RankFailed(f"rank {rank} of {world} raised in {fn.__name__}:\n{text}")


_POOL = _Pool()
atexit.register(_POOL.close)


def run_ranks(fn: Callable[..., None], args: tuple = (), *, world: int,
              timeout: float = 120.0) -> None:
    """Run ``fn(rank, *args)`` on ranks ``0..world-1`` of the session's pool, together, and
    wait for all of them (``fn`` must be importable by name, as for ``spawn``)."""
    _POOL.run(fn, args, world, timeout)
