"""One round of a save: the files of the round moved to their writers a piece at a time, and written.

The plan of each file's packed bytes and its pieces is ``_hf_gather``. Here each piece
moves by one ``reshard`` of a 1-D byte array (the owners' shard bytes in, each file's
piece on its writer out), and the writer hands it to a thread that writes its runs to
the file while the next piece moves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fshard._api.move import reshard
from fshard._array.array import ShardedArray
from fshard._checkpoint._format import resolved
from fshard._checkpoint._hf_commit import writing
from fshard._checkpoint._hf_gather import FilePlan, Piece, piece, pieces, plan_file
from fshard._checkpoint._hf_write import header_bytes
from fshard._checkpoint._ranges import Runs, byte_view, whole, write_runs
from fshard._errors import CheckpointError
from fshard.backends import Backend

__all__ = ["PIECE_BYTES", "write_round"]


# Bytes of a file moved to its writer at once: a writer holds at most two pieces, not a whole file.
PIECE_BYTES = 64 << 20


def write_round(
    chosen: list[int],
    files: list[list[int]],
    names: list[str],
    writers: list[int],
    leaves: list[tuple[str, Any]],
    backend: Backend,
    stage: Path,
    failed: list[CheckpointError],
) -> None:
    """Moves the files ``chosen`` to their writers a piece at a time; writes those this process writes.

    A write that fails here is recorded in ``failed``, and this process goes on moving (every
    rank takes part in every movement) but writes nothing more.
    """
    values = [leaf for _, leaf in leaves]
    plans = [plan_file(values, files[k], writers[k]) for k in chosen]
    with ThreadPoolExecutor(1, thread_name_prefix="fshard-write") as pool:
        out: dict[int, _Output] = {}
        for j, k in enumerate(chosen):
            if backend.holds(writers[k]):
                entries = [(leaves[i][0], values[i].dtype, tuple(values[i].shape)) for i in files[k]]
                out[j] = _Output(stage / names[k], header_bytes(entries), failed)
        try:
            for s in range(pieces(plans, PIECE_BYTES)):
                part = piece(plans, s, PIECE_BYTES)
                moved = {} if part is None else _move(part, plans, values, backend)
                for j, o in out.items():
                    got = None if part is None else part.files[j]
                    if got is not None:
                        o.write(pool, got[1], moved[got[0]])
        finally:
            for o in out.values():
                o.finish()


class _Output:
    """A file this process writes: its header at once, then its pieces in a thread, fsynced at the end."""

    def __init__(self, path: Path, head: bytes, failed: list[CheckpointError]) -> None:
        self.path, self.failed, self.base = path, failed, len(head)
        self.fd: int | None = None
        self.pending: Future[None] | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)

        def start() -> None:
            self.fd = os.open(path, flags, 0o644)
            write_runs(self.fd, 0, whole(len(head)), memoryview(head))

        self._guard(start)

    def _guard(self, fn: Callable[[], None]) -> None:
        if self.failed:
            return
        try:
            with writing(self.path):
                fn()
        except CheckpointError as exc:
            self.failed.append(exc)

    def write(self, pool: ThreadPoolExecutor, spans: Runs, data: torch.Tensor) -> None:
        """Writes the runs of one piece, in the thread, once the previous piece is written."""
        self._wait()
        fd = self.fd
        if self.failed or fd is None:
            return
        data = data if data.device.type == "cpu" else data.cpu()
        self.pending = pool.submit(self._guard, lambda: write_runs(fd, self.base, spans, byte_view(data)))

    def _wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def finish(self) -> None:
        """Waits for the last piece, fsyncs and closes."""
        self._wait()
        fd, self.fd = self.fd, None
        if fd is not None:
            self._guard(lambda: os.fsync(fd))
            os.close(fd)


def _held(leaf: Any, backend: Backend) -> dict[int | None, torch.Tensor]:
    """This process's tensors of ``leaf`` by shard index (``None`` for a plain tensor)."""
    if isinstance(leaf, ShardedArray):
        return dict(zip(backend.addressable(leaf.layout), leaf.addressable_data))
    return {None: leaf}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return resolved(t.detach()).contiguous().reshape(-1).view(torch.uint8)


def _move(part: Piece, plans: list[FilePlan], values: list[Any], backend: Backend) -> dict[int, torch.Tensor]:
    """One piece of every file of a round on its writer: this process's, by their start in the piece's bytes."""
    held: dict[int, dict[int | None, torch.Tensor]] = {}
    packed: dict[tuple[int, int | None], torch.Tensor] = {}
    data: list[torch.Tensor] = []
    for r in backend.addressable(part.source):
        j, k, skip = part.rows[r]
        li, shard = plans[j].sources[k]
        if li not in held:
            held[li] = _held(values[li], backend)
        if (li, shard) not in packed:
            packed[li, shard] = _bytes(held[li][shard])
        n = int(part.source.columns.sz[r, 0])
        data.append(packed[li, shard][skip : skip + n])
    moved = reshard(ShardedArray(part.source, data, backend, torch.uint8), part.target)
    starts = part.target.columns.lo[:, 0]
    return {int(starts[i]): t for i, t in zip(backend.addressable(part.target), moved.addressable_data)}
