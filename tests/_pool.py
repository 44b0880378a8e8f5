"""A pool of Gloo worker processes for multi-process tests, started once per session.

``Pool.run(fn, *args)`` sends a module-level function (by module and qualname) to every
worker, which calls it as its rank of a 4-process group and returns the result. A
failure on any rank re-raises here with that rank's traceback; a run that does not
finish in time fails naming the test. After either, the pool restarts with fresh
processes, so one broken test cannot leave data in flight for the next.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from fshard.testing.launch import free_port, receive, serve, stop

__all__ = ["Pool", "RankFailure"]


class RankFailure(AssertionError):
    """A test function raised on one or more ranks of the pool."""


class Pool:
    """``world`` Gloo processes on 127.0.0.1 that run test functions on demand."""

    def __init__(self, world: int = 4, timeout: float = 60.0, start_timeout: float = 120.0) -> None:
        self.world, self.timeout, self.start_timeout = world, timeout, start_timeout
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.starts = 0

    def start(self) -> None:
        """Spawns the workers and waits until every one has joined the group."""
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, args=(rank, self.world, port, child), daemon=True, name=f"fshard-pool-{rank}")
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self.starts += 1
        replies = self._gather(self.start_timeout, "starting the pool")
        if replies is None or any(r != ("ready", k) for k, r in enumerate(replies)):
            self.close()
            raise RuntimeError(f"The Gloo worker pool did not start: {replies}")

    def close(self, grace: float = 2.0) -> None:
        """Stops every worker (terminating those still busy after ``grace`` seconds)."""
        for c in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                c.send(None)
        stop(self._procs, grace=grace)
        self._procs, self._conns = [], []

    def restart(self) -> None:
        """Replaces every worker with a fresh process (after a hang or a crash)."""
        self.close(grace=0.0)
        self.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Calls ``fn(*args, **kwargs)`` on every rank; returns the results in rank order.

        Raises:
            RankFailure: ``fn`` raised on some rank (the message holds each failing
                rank's traceback).
            TimeoutError: the ranks did not all finish in ``timeout`` seconds; the
                pool is restarted.
        """
        __tracebackhide__ = True
        if not self._procs:
            self.start()
        name = f"{fn.__module__}.{fn.__qualname__}"
        job = (fn.__module__, fn.__qualname__, inspect.getsourcefile(fn), args, kwargs)
        for c in self._conns:
            c.send(job)
        replies = self._gather(timeout or self.timeout, name)
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        if replies is None:
            self.restart()
            msg = (
                f"{name} (test {test}) did not finish on every rank within {timeout or self.timeout} s; pool restarted."
            )
            raise TimeoutError(msg)
        failed = [
            (k, "no reply: still waiting (in a collective that a failed rank never joined?)" if r is None else r[1])
            for k, r in enumerate(replies)
            if r is None or r[0] is not True
        ]
        if failed:
            self.restart()  # a failed rank may have left messages in flight: start clean
            text = "\n".join(f"--- rank {k} ---\n{tb}" for k, tb in failed)
            raise RankFailure(f"{name} (test {test}) failed on ranks {[k for k, _ in failed]}:\n{text}")
        return [r[1] for r in replies]

    def _gather(self, timeout: float, what: str) -> list[Any] | None:
        """One reply per worker; after a failure the rest get a short grace (they may be stuck
        in a collective the failing rank never joined). ``None`` if nobody failed yet time ran out."""
        replies: list[Any] = [None] * self.world
        got: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            pending = [c for k, c in enumerate(self._conns) if k not in got]
            ready = wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                return replies if any(r is not None and r[0] is False for r in replies) else None
            for k in [k for k, c in enumerate(self._conns) if c in ready]:
                got.add(k)
                try:
                    replies[k] = receive(self._conns[k])
                except EOFError:
                    replies[k] = (False, f"worker {k} died while running {what}")
                if replies[k][0] is False:
                    deadline = min(deadline, time.monotonic() + 10.0)
        return replies


def outcome(
    fn: Callable[[], Any], *, check: bool = True, timeout: float = 60.0, catch: type[BaseException] = Exception
) -> tuple[str, str, list[str]] | None:
    """``fn()`` with check mode on (or off): (type name, message, notes) of what it raised (a ``catch``), or None."""
    import fshard

    old = fshard.config(check_collectives=check, check_timeout=timeout)
    try:
        fn()
    except catch as exc:
        return type(exc).__name__, str(exc), list(getattr(exc, "__notes__", []))
    finally:
        fshard.config(check_collectives=old.check_collectives, check_timeout=old.check_timeout)
    return None
