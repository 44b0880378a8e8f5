"""Writing: one writer per distinct box, each rank's safetensors file, and the atomic index commit."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file  # pyright: ignore[reportUnknownVariableType]  # its stub: a bare PathLike

from fshard._array.array import ShardedArray
from fshard._checkpoint._collective import progress_bar
from fshard._checkpoint._format import (
    DATA_RE,
    FILE_RE,
    FORMAT,
    INDEX,
    TMP_RE,
    box_text,
    file_name,
    fsync,
    hashing,
    resolved,
    sha256,
)
from fshard._checkpoint._lock import LOCK
from fshard._errors import CheckpointError
from fshard._layout.layout import Layout
from fshard.backends import Backend


@dataclasses.dataclass(frozen=True)
class Box:
    """One box written once: its leaf, extent, writer (rank and shard index) and tensor name."""

    leaf: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    shard: int | None
    name: str

    @property
    def file(self) -> str:
        return file_name(self.rank)


def _distinct(layout: Layout) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]:
    """Each distinct non-empty box of ``layout`` and the shards (replicas) holding it, in layout order."""
    out: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, s in enumerate(layout.shards):
        if s.numel:
            out.setdefault((s.offsets, s.sizes), []).append(i)
    return out


# A box to write: (leaf index, box number in the leaf, (offsets, sizes), itemsize, the (rank, shard) that hold it).
_Candidate = tuple[int, int, tuple[tuple[int, ...], tuple[int, ...]], int, list[tuple[int, int | None]]]


def assign(leaves: Sequence[tuple[str, Any]], holders: Sequence[int]) -> list[Box]:
    """Chooses one writer per distinct box: largest boxes first, each to its least-loaded replica.

    A pure function of the layouts, shapes and dtypes, so every rank computes the
    same answer without communication. Plain tensors may go to any of ``holders``.
    """
    items: list[_Candidate] = []
    for li, (_, leaf) in enumerate(leaves):
        if isinstance(leaf, ShardedArray):
            shards = leaf.layout.shards
            for k, (box, idx) in enumerate(_distinct(leaf.layout).items()):
                items.append((li, k, box, leaf.dtype.itemsize, [(shards[i].placement.rank, i) for i in idx]))
        elif isinstance(leaf, torch.Tensor) and leaf.numel():
            box = ((0,) * leaf.ndim, tuple(leaf.shape))
            items.append((li, 0, box, leaf.dtype.itemsize, [(r, None) for r in holders]))
    load: dict[int, int] = {}
    boxes: list[Box] = []
    for li, _, (lo, sz), item, who in sorted(items, key=lambda t: (-math.prod(t[2][1]) * t[3], t[0], t[1])):
        rank, shard = min(who, key=lambda c: (load.get(c[0], 0), c[0], c[1] or 0))
        load[rank] = load.get(rank, 0) + math.prod(sz) * item
        boxes.append(Box(li, lo, sz, rank, shard, f"{leaves[li][0]}@{box_text(lo, sz)}"))
    return sorted(boxes, key=lambda b: (b.leaf, b.offsets))


def _held(leaves: Sequence[tuple[str, Any]], backend: Backend) -> list[dict[int | None, torch.Tensor]]:
    """Per leaf, the tensors this process would write, by shard index (``None`` for a plain tensor)."""
    out: list[dict[int | None, torch.Tensor]] = []
    for _, leaf in leaves:
        if isinstance(leaf, ShardedArray):
            out.append(dict(zip(backend.addressable(leaf.layout), leaf.addressable_data)))
        else:
            out.append({None: leaf} if isinstance(leaf, torch.Tensor) else {})
    return out


def _box_data(box: Box, held: dict[int | None, torch.Tensor], backend: Backend) -> torch.Tensor | None:
    """This process's tensor for ``box`` if it is the box's writer, else ``None``."""
    if box.shard is None and not backend.holds(box.rank):
        return None
    t = held.get(box.shard)
    return None if t is None else resolved(t.detach().to("cpu")).contiguous()


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every one whose memory overlaps an earlier one copied (safetensors refuses overlap)."""
    out, end = dict(tensors), -1
    for lo, hi, name in sorted((t.data_ptr(), t.data_ptr() + t.nbytes, n) for n, t in tensors.items() if t.nbytes):
        if lo < end:
            out[name] = tensors[name].clone()
        else:
            end = hi
    return out


def check_root(root: Path, own: str) -> None:
    """Refuses to write into a path that holds something other than an fshard checkpoint.

    ``own`` is this save's data directory, which other ranks may be writing already.
    """
    try:
        exists, is_dir = root.exists(), root.is_dir()
    except OSError as exc:
        raise CheckpointError(f"Checkpoint path {root} cannot be used: {exc.strerror or exc}.") from exc
    if exists and not is_dir:
        raise CheckpointError(f"Checkpoint path {root} exists and is not a directory: save to a directory path.")
    if not exists:
        above = next(p for p in root.absolute().parents if p.exists())
        if not above.is_dir():
            raise CheckpointError(f"Checkpoint path {root} lies under {above}, which is not a directory.")
    index = root / INDEX
    if is_dir and (index.is_symlink() or index.exists()) and not index.is_file():
        msg = (
            f"Checkpoint path {root} holds {index}, which is not a file: remove or rename it (it is no index "
            "fshard wrote), or save to another path."
        )
        raise CheckpointError(msg)
    if is_dir and not index.exists():
        # What a racing save may be writing meanwhile is no foreign file (its lock settles the race): its data
        # directory, its temporary index, or the index it has just committed.
        spare = {own, LOCK, INDEX}
        foreign = sorted(
            p.name for p in root.iterdir() if not (p.name in spare or _fshard_shaped(p) or TMP_RE.match(p.name))
        )
        if foreign:
            msg = (
                f"Checkpoint path {root} is a non-empty directory without {INDEX} (it holds {foreign[:3]}): "
                "save to a new or empty directory, or to an existing fshard checkpoint to replace it."
            )
            raise CheckpointError(msg)


def write_files(
    root: Path,
    data: Path,
    leaves: Sequence[tuple[str, Any]],
    boxes: Sequence[Box],
    backend: Backend,
    progress: Any,
    known: dict[str, str],
) -> dict[str, dict[str, Any]]:
    """Writes this process's files (fsynced); returns, per file, its rank, size and tensor hashes.

    ``known``: SHA-256 of tensors already hashed (by name), not hashed again.
    """
    check_root(root, data.name)
    per_file: dict[int, dict[str, torch.Tensor]] = {}
    held = _held(leaves, backend)
    for box in boxes:
        t = _box_data(box, held[box.leaf], backend)
        if t is not None:
            per_file.setdefault(box.rank, {})[box.name] = t
    with _writing(root, data):
        data.mkdir(parents=True, exist_ok=True)
    written: dict[str, dict[str, Any]] = {}
    total = sum(t.nbytes for d in per_file.values() for t in d.values())
    with progress_bar("fshard.save", total, progress, backend) as bar, hashing() as pool:
        files = sorted(per_file.items())
        hashes = [{n: pool.submit(sha256, t) for n, t in tensors.items() if n not in known} for _, tensors in files]
        synced: list[tuple[Path, Future[None]]] = []
        for (rank, tensors), digests in zip(files, hashes):
            target = data / file_name(rank)
            with _writing(root, target):
                save_file(_unshared(tensors), str(target), metadata={"format": FORMAT, "rank": str(rank)})
                synced.append((target, pool.submit(fsync, target)))  # flushes while the next file is written
                size = target.stat().st_size
            sha = {n: digests[n].result() if n in digests else known[n] for n in tensors}
            written[target.name] = {"rank": rank, "bytes": size, "sha256": sha}
            bar.update(sum(t.nbytes for t in tensors.values()))
        for target, f in synced:
            with _writing(root, target):
                f.result()
    with _writing(root, data):
        fsync(data, directory=True)  # the files' directory entries, before an index can name them
    return written


@contextlib.contextmanager
def _writing(root: Path, path: Path) -> Generator[None, None, None]:
    """Turns a failure to write ``path`` into a ``CheckpointError`` naming it and the cause.

    The failure may be a full disk, a file-size limit or a read-only file system. Nothing is
    committed, so the previous checkpoint stands.
    """
    try:
        yield
    except (OSError, SafetensorError) as exc:
        cause = f"{exc.strerror} (errno {exc.errno})" if isinstance(exc, OSError) and exc.strerror else str(exc)
        msg = (
            f"Saving checkpoint {root} failed writing {path}: {cause}. Nothing was committed: the previous "
            "checkpoint there (if any) is unchanged. Free space or fix the file system, then save again."
        )
        raise CheckpointError(msg) from exc


def _check_present(data: Path, files: dict[str, Any]) -> None:
    """Refuses to commit an index whose data files are not all there with their recorded sizes.

    The committing rank holds the save lock, but other ranks wrote their files before it was taken:
    a save to this path that committed in between deleted them as old data.
    """
    for name, record in files.items():
        try:
            size = (data / name).stat().st_size
        except OSError:
            size = None
        if size != record["bytes"]:
            msg = (
                f"Checkpoint file {data / name} is {'gone' if size is None else f'{size} bytes'} before the commit "
                f"(written with {record['bytes']} bytes): another save to {data.parent} deleted it. One save at a "
                "time per path; nothing was committed."
            )
            raise CheckpointError(msg)


def commit(root: Path, index: dict[str, Any], token: str) -> None:
    """Writes ``index.json`` atomically (temporary file, fsync, rename), then drops older data."""
    tmp = root / f"{INDEX}.{token}.tmp"
    _check_present(root / index["data"], index["files"])
    with _writing(root, tmp):
        fsync(root, directory=True)  # the data directory's entry, before the index that names it
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    with _writing(root, root / INDEX):
        os.replace(tmp, root / INDEX)
    fsync(root, directory=True)
    # The commit is done: what follows only tidies up, and a failure there fails nothing.
    for p in root.iterdir():
        if p.name != index["data"] and _ours(p):
            shutil.rmtree(p, ignore_errors=True)
        elif TMP_RE.match(p.name) and p.is_file():
            with contextlib.suppress(OSError):
                p.unlink()


def _fshard_shaped(p: Path) -> bool:
    """Whether ``p`` is a save's data directory, finished or still being written.

    That is ``_ours``, or a ``data.<32 hex>`` directory whose other entries are the temporary
    files that safetensors writes before renaming them (``.tmpXXXXXX``).
    """
    if not DATA_RE.match(p.name) or p.is_symlink() or not p.is_dir():
        return False
    try:
        return all((FILE_RE.match(f.name) or _WRITING_RE.match(f.name)) and not f.is_symlink() for f in p.iterdir())
    except OSError:
        return False


_WRITING_RE = re.compile(r"^\.tmp[A-Za-z0-9_]{6}$")


def _ours(p: Path) -> bool:
    """Whether ``p`` is a data directory a save wrote: ``data.<32 hex>`` holding only ``rank-N.safetensors`` files.

    Anything else, even with such a name, is left alone: save never deletes what it did not write.
    """
    if not DATA_RE.match(p.name) or p.is_symlink() or not p.is_dir():
        return False
    try:
        return all(FILE_RE.match(f.name) and f.is_file() and not f.is_symlink() for f in p.iterdir())
    except OSError:
        return False


def committed(root: Path, data: str) -> bool:
    """Whether the index on disk names the data directory ``data``."""
    try:
        return json.loads((root / INDEX).read_text(encoding="utf-8")).get("data") == data
    except (OSError, ValueError, AttributeError):
        return False
