"""Gloo process groups on this machine: ``launch`` runs a function on N fresh processes.

``torch.distributed`` is imported inside the functions that start a group, so importing
fshard never pulls in process-group code.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["check_main", "free_port", "init_group", "launch", "receive", "reply", "serve"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_group(rank: int, world: int, port: int, timeout: float = 120.0, backend: str = "gloo") -> None:
    """Joins a group of ``world`` processes rendezvousing on ``127.0.0.1:port``.

    Each process gets an equal share of the CPU cores for torch's intra-op threads;
    with ``backend="nccl"`` rank ``r`` uses GPU ``r % torch.cuda.device_count()``.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _run(rank: int, world: int, port: int, conn: Connection, job: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    fn, args, timeout, backend = job
    try:
        init_group(rank, world, port, timeout, backend)
        reply(conn, (True, fn(*args)))
    except BaseException:  # report every failure to the parent, which re-raises it
        reply(conn, (False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def reply(conn: Connection, message: tuple[Any, ...]) -> None:
    """Sends ``message`` to the parent as plain pickled bytes; an unpicklable one as the traceback of why.

    Not through ``Connection.send``: its pickler hands tensors over in shared memory, whose file
    descriptors the parent fetches from this process, which may have exited by then.
    """
    try:
        data = pickle.dumps(message)
    except Exception:  # an unpicklable result
        data = pickle.dumps((False, traceback.format_exc()))
    conn.send_bytes(data)


def receive(conn: Connection) -> Any:
    """What a worker sent with ``reply``."""
    return pickle.loads(conn.recv_bytes())


def launch(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120, backend: str = "gloo") -> list[Any]:
    """Runs ``fn(*args)`` on ``world`` new processes on 127.0.0.1; returns their results.

    ``fn`` must be picklable (a module-level function) and so must its results.
    Every process is stopped before this returns.

    Args:
        fn: called once per process after ``torch.distributed`` is initialised.
        world: number of processes (ranks 0 .. world - 1).
        *args: passed to ``fn`` on every rank.
        timeout: seconds for the whole run.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).

    Returns:
        The results in rank order.

    Raises:
        RuntimeError: a rank raised; the message holds that rank's traceback.
        TimeoutError: the ranks did not all finish within ``timeout`` seconds.
        ValueError: ``world`` below 1, or a ``timeout`` that is not a positive number.

    >>> from fshard.testing.launch import launch
    >>> launch(abs, 1, -3)
    [3]
    """
    if world < 1:
        raise ValueError(f"launch() needs world >= 1, got {world}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
        raise ValueError(f"launch() needs a timeout of some seconds, a positive number, got {timeout!r}.")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_run, args=(rank, world, port, child, (fn, args, timeout, backend)), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    try:
        results = _collect(conns, procs, fn, timeout)
    except BaseException:
        stop(procs, grace=0.0)  # ranks still running may be stuck in a collective
        raise
    stop(procs)
    return results


def _collect(conns: list[Connection], procs: list[BaseProcess], fn: Callable[..., Any], timeout: float) -> list[Any]:
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(conns):
        pending = [c for r, c in enumerate(conns) if r not in results]
        ready = wait(pending, max(0.0, deadline - time.monotonic()))
        if not ready:
            missing = [r for r in range(len(conns)) if r not in results]
            raise TimeoutError(f"launch({_name(fn)}) timed out after {timeout} s; ranks {missing} did not finish.")
        for rank in [r for r, c in enumerate(conns) if c in ready]:
            try:
                results[rank] = receive(conns[rank])
            except EOFError:
                results[rank] = (False, f"rank {rank} exited without a result ({_exit(procs[rank])}).")
            if not results[rank][0]:
                raise RuntimeError(f"launch({_name(fn)}) failed on rank {rank}:\n{results[rank][1]}")
    return [results[r][1] for r in range(len(conns))]


def stop(procs: list[Any], grace: float = 5.0) -> None:
    """Stops processes: waits up to ``grace`` seconds, then terminates, then kills."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


def _exit(proc: BaseProcess) -> str:
    """How ``proc``, whose end of the pipe closed without a result, ended: its exit code or signal."""
    proc.join(5.0)  # the pipe closes as the process exits: its code follows at once
    code = proc.exitcode
    if code is None:
        return "its pipe closed; still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def serve(rank: int, world: int, port: int, conn: Connection) -> None:
    """A pool worker: joins the group, then runs ``(module, qualname, path, args, kwargs)`` jobs.

    Replies ``("ready", rank)`` once the group is up, then ``(True, result)`` or
    ``(False, traceback)`` per job; ``None`` stops it.
    """
    init_group(rank, world, port)
    reply(conn, ("ready", rank))
    while (job := conn.recv()) is not None:
        try:
            done: tuple[bool, Any] = (True, _resolve(*job[:3])(*job[3], **job[4]))
        except BaseException:  # reported to the parent, which re-raises it in the test
            done = (False, traceback.format_exc())
        reply(conn, done)


def _resolve(module: str, qualname: str, path: str | None) -> Callable[..., Any]:
    import importlib
    import sys

    if module not in sys.modules and path and os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def check_main(
    check: Callable[[range], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
    argv: Sequence[str] | None = None,
    description: str | None = None,
) -> int:
    """The command line of a self-checking example: ``check(ranks)`` returns a result with ``"ok"``.

    It runs on the local backend once per ``--ranks`` count (default 1, 2 and 4), on
    ``--world N`` spawned Gloo processes, or, under torchrun, on the processes torchrun
    started; prints ``report`` of each result (rank 0's across processes) and returns 0
    when every check passed, else 1.
    """
    import argparse

    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="local backend: simulated ranks")
    parser.add_argument("--world", type=int, default=0, help="spawn this many Gloo processes instead")
    args = parser.parse_args(argv)
    if min(args.ranks) < 1:
        parser.error(f"--ranks must all be at least 1, got {args.ranks}")
    if args.world < 0:
        parser.error(f"--world must be at least 1 (or 0: no processes), got {args.world}")
    if "RANK" in os.environ and not dist.is_initialized():  # started by torchrun
        dist.init_process_group("gloo")
        try:
            results = [check(range(dist.get_world_size()))]
        finally:
            dist.destroy_process_group()
        show = results if int(os.environ["RANK"]) == 0 else []
    elif args.world:
        results = launch(check, args.world, range(args.world))
        show = results[:1]
    else:
        results = [check(range(n)) for n in args.ranks]
        show = results
    for r in show:
        print(report(r))
    return 0 if all(r["ok"] for r in results) else 1
