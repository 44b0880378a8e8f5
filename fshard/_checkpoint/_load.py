"""``fshard.load``: a checkpoint into the target layouts on the current ranks, reading only overlaps."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from fshard._array.array import ShardedArray
from fshard._base.alloc import new
from fshard._checkpoint._collective import agree_on, progress_bar
from fshard._checkpoint._dcp import load_dcp
from fshard._checkpoint._detect import checkpoint_kind
from fshard._checkpoint._format import INDEX, Saved, check_flag, check_not_partial, checkpoint_path, read_index
from fshard._checkpoint._hf import load_hf
from fshard._checkpoint._reader import Reader, slices
from fshard._checkpoint._schema import saved_leaves
from fshard._checkpoint._tree import match, unflatten
from fshard._errors import CheckpointError, SpecError
from fshard._exec.collective import collective
from fshard._layout.index import index
from fshard._layout.layout import Layout, ShardMeta, layout_digest
from fshard._layout.placement import Placement
from fshard._layout.specs import as_layout
from fshard.backends import Backend, default_backend

__all__ = ["load"]


_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class _Target:
    """What to build for one leaf: a ShardedArray in ``layout`` on ``backend``, a tensor, or the value."""

    kind: str
    layout: Layout | None = None
    backend: Backend | None = None
    device: torch.device = _CPU
    requires_grad: bool = False


def _mismatch(saved: Saved, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"Leaf {saved.where} of the checkpoint {what}: {fix}.")


def _target_like(saved: Saved, like: Any) -> _Target:
    if saved.kind == "scalar" and saved.value is None:  # saved with no value there (an optimizer state a
        return _Target("value")  # parameter did not have): loaded as None, whatever like holds there
    if saved.kind == "scalar":
        numbers = {int, float}  # stand for each other, as in torch's hyperparameters (weight_decay=0 or 1e-5)
        if type(like) is not type(saved.value) and not {type(like), type(saved.value)} <= numbers:
            what = f"is the {type(saved.value).__name__} {saved.value!r}, `like` has a {type(like).__name__}"
            raise _mismatch(saved, what, "give a value of the saved type there")
        return _Target("value")
    if not isinstance(like, (ShardedArray, torch.Tensor)):
        what = f"is a tensor of shape {saved.shape}, `like` has a {type(like).__name__}"
        raise _mismatch(saved, what, "give a ShardedArray or tensor there")
    if tuple(like.shape) != saved.shape or like.dtype != saved.dtype:
        what = (
            f"has shape {saved.shape} and dtype {saved.dtype}, `like` has shape {tuple(like.shape)} and "
            f"dtype {like.dtype}"
        )
        raise _mismatch(saved, what, "give the saved shape and dtype, and convert after loading")
    if isinstance(like, ShardedArray):
        check_not_partial(f"Leaf {saved.where}", like.layout)
        return _Target("array", like.layout, like.backend, requires_grad=like.requires_grad)
    return _Target("tensor", device=like.device, requires_grad=like.requires_grad)


def _target_spec(saved: Saved, spec: Any, backend: Backend | None) -> _Target:
    if saved.kind == "scalar":
        return _Target("value")
    if spec is None:
        return _Target("tensor")
    b = default_backend() if backend is None else backend
    try:
        layout = as_layout(spec, saved.shape)
    except SpecError as exc:
        raise SpecError(f"Leaf {saved.where} ({saved.dtype}, shape {saved.shape}): {exc}") from None
    check_not_partial(f"Leaf {saved.where}", layout)
    b.check_layout(layout)
    return _Target("array", layout, b)


def _target_saved(saved: Saved, backend: Backend | None) -> _Target:
    if saved.kind != "array" or saved.layout is None:
        return _Target("value" if saved.kind == "scalar" else "tensor")
    b = default_backend() if backend is None else backend
    try:
        b.check_layout(saved.layout)
    except SpecError as exc:
        msg = (
            f"Leaf {saved.where} was saved in a layout this backend cannot hold ({exc}): "
            "pass specs= or like= with layouts on the current ranks."
        )
        raise CheckpointError(msg) from exc
    return _Target("array", saved.layout, b)


# Per saved box, the pieces it feeds: (offsets, sizes, index of the shard of ``layout`` they fill).
_Pieces = dict[int, list[tuple[tuple[int, ...], tuple[int, ...], int]]]


def _sources(saved: Saved, layout: Layout, shards: Iterable[int]) -> _Pieces:
    """Per saved box, the pieces of it that fill ``shards`` (indices into ``layout``).

    Found in the saved boxes' index for these shards alone, so a rank's cost grows with the
    pieces it reads, not with the world's.
    """
    targets = np.array(sorted(j for j in shards if layout.columns.sz[j].all()), np.int64)
    if not len(targets):
        return {}
    assert saved.source is not None
    src = index(saved.source)
    lo = layout.columns.lo[targets]
    hi = lo + layout.columns.sz[targets]
    q, box = src.query(lo, hi)
    start = np.maximum(lo[q], src.lo[box])
    size = np.minimum(hi[q], src.hi[box]) - start
    lowest = np.minimum.reduceat(src.copies, src.copy_start)  # a box saved twice is read from its first copy
    pieces: _Pieces = {}
    for b, j, a, n in zip(lowest[box].tolist(), targets[q].tolist(), start.tolist(), size.tolist()):
        pieces.setdefault(b, []).append((tuple(a), tuple(n), j))
    return pieces


def _fill(
    saved: Saved, layout: Layout, out: dict[int, torch.Tensor], reader: Reader, bar: Any, pieces: _Pieces
) -> None:
    """Writes the saved values into the shards ``out`` (indices into ``layout``), reading only overlaps.

    ``pieces``: ``_sources(saved, layout, out)``.
    """
    for src, wanted in pieces.items():
        box = saved.boxes[src]
        whole = reader.whole(box, saved) if reader.verify else None
        for lo, size, j in wanted:
            read = slices(lo, size, box["offsets"])
            piece = whole[read] if whole is not None else reader.part(box, saved, read)
            out[j][slices(lo, size, layout.columns.lo[j].tolist())].copy_(piece)
            bar.update(piece.nbytes)


def _read_leaf(saved: Saved, target: _Target, reader: Reader, bar: Any) -> Any:
    if target.kind == "value":
        return saved.value
    assert saved.dtype is not None
    if target.kind == "tensor":
        layout = Layout(saved.shape, (ShardMeta((0,) * len(saved.shape), saved.shape, Placement(0)),))
        index: tuple[int, ...] = (0,)
    else:
        assert target.layout is not None
        assert target.backend is not None
        layout, index = target.layout, target.backend.addressable(target.layout)
    # Replicas on this process are read once and copied.
    boxes = {i: (layout.shards[i].offsets, layout.shards[i].sizes) for i in index}
    first: dict[tuple[Any, ...], int] = {}
    for i in index:
        first.setdefault(boxes[i], i)
    sources = _sources(saved, layout, first.values())
    for src in sources:  # every file's size checked against the index before anything is allocated from it
        reader.open_box(saved.boxes[src], saved)
    out = {i: _new(layout, i, saved.dtype, target) for i in first.values()}
    _fill(saved, layout, out, reader, bar, sources)
    data = [out[i] if i in out else out[first[boxes[i]]].clone() for i in index]
    data = [t.requires_grad_() if target.requires_grad else t for t in data]
    if target.kind == "tensor":
        return data[0]
    return ShardedArray(layout, data, target.backend, saved.dtype, requires_grad=target.requires_grad)


def _new(layout: Layout, i: int, dtype: torch.dtype, target: _Target) -> torch.Tensor:
    device = target.device if target.kind == "tensor" else torch.device(layout.shards[i].placement.device)
    return new(layout.shards[i].sizes, dtype, device)  # on the CPU, recycled memory where a dead array left some


def _targets(saved: list[Saved], tree: dict[str, Any], like: Any, specs: Any, backend: Backend | None) -> list[_Target]:
    given: dict[int, Any] = {}
    if like is not None:
        match(tree, like, "", given, prefix=False)
        return [_target_like(s, given[i]) for i, s in enumerate(saved)]
    if specs is not None:
        match(tree, specs, "", given, prefix=True)
        return [_target_spec(s, given[i], backend) for i, s in enumerate(saved)]
    return [_target_saved(s, backend) for s in saved]


@collective("load")
def load(
    path: str | os.PathLike[str],
    like: Any = None,
    specs: Any = None,
    *,
    dtype: torch.dtype | None = None,
    rename: Any = None,
    fuse: Any = None,
    verify: bool = True,
    backend: Backend | None = None,
    progress: bool | None = None,
) -> Any:
    """Reads a checkpoint into the target layouts on the current ranks (collective).

    The world size and layouts at save time do not matter. Each process reads,
    for each of its target shards, only the parts of the saved boxes that
    overlap it, through ``safetensors.safe_open(...).get_slice``.

    Verification (``verify=True``, the default) checks each saved box against
    its sha256 in ``index.json``. A hash covers a whole saved box, so a process
    then reads every saved box that overlaps one of its target shards *in full*
    (once, however many of its shards it feeds) and hashes it: at most the
    saved boxes' bytes instead of the target shards' bytes, plus SHA-256 at
    about 1.5 GB/s per core. With ``verify=False`` only the overlapping byte
    ranges are read and data tampering goes unnoticed; file sizes, tensor
    names, dtypes and shapes are checked either way.

    ``path`` may also be a checkpoint of another library, read into any spec on any world
    size, each rank reading only the byte ranges of its boxes and each replicated box read
    once per job; ``verify`` does not apply (neither format stores hashes). The result is
    a dict of names to arrays (plain tensors without ``like`` and ``specs``). ``specs``
    maps names to specs (names it lacks are not read), or is a function ``(name, shape,
    dtype) -> spec | None`` or one spec for every tensor; ``like`` maps names to arrays or
    tensors.

    - A Hugging Face checkpoint: one ``.safetensors`` file, a folder with
      ``model.safetensors.index.json``, or a folder of ``.safetensors`` files. Every header
      is checked before any data is read; ``dtype``, ``rename`` and ``fuse`` apply. See
      docs/interop.md.
    - A torch DCP folder (``.metadata`` and ``*.distcp``, written by
      ``torch.distributed.checkpoint``): its metadata is read by an allow-list unpickler,
      so nothing in it runs. Names are DCP's flattened ones (``model.layer.weight``);
      entries that are not tensors come back as the raw ``bytes`` DCP stored, never
      unpickled. See docs/interop-dcp.md.

    Args:
        path: a directory written by ``fshard.save``, a Hugging Face safetensors file or
            folder, or a torch DCP folder.
        like: a tree shaped like the saved one: a ``ShardedArray`` leaf gives the
            target layout and backend, a tensor gives a plain tensor (on its
            device); shapes and dtypes must match the saved ones.
        specs: instead of ``like``: a tree of specs or ``Layout``s (``None`` for a
            plain tensor). A spec where the checkpoint has a subtree applies to
            every tensor in it; scalars ignore their spec.
        dtype: Hugging Face only: cast every array to this dtype after reading (default:
            the dtype of ``like``'s entry, else the file's).
        rename: Hugging Face only: a mapping of checkpoint names to new names (names it
            lacks keep theirs; a name the checkpoint lacks is refused) or a function of the
            name, applied before ``fuse``.
        fuse: Hugging Face only: a list of ``fshard.Split`` and ``fshard.Concat``, applied
            in order after ``rename``: one tensor read as several arrays, or several as one.
        verify: check per-box sha256 hashes.
        backend: for ``specs`` (and for neither): the backend of the new arrays
            (default: torch_dist when initialised, else local). Without ``like``
            or ``specs``, arrays come back in their saved layouts.
        progress: show a progress bar (``None``: on a terminal, above ``PROGRESS_MIN_BYTES``).

    Returns:
        The saved tree (dicts, lists, tuples) with arrays in the target layouts.

    A load during a save to the same path returns the old or the new checkpoint,
    whole: when the save deletes files this load still needed, it starts over
    from the new index (on every rank together; under ``torch_dist`` also when
    ranks read different indexes).

    Raises:
        TypeError: ``path`` is not a str or an ``os.PathLike``, ``verify`` not a bool,
            ``progress`` not a bool or ``None``, or ``backend`` not a backend.
        CheckpointError: a missing index or file, an index that was edited (it no
            longer matches its digest) or is malformed (naming the field), a
            truncated or tampered file, a tree, shape or dtype that does not
            match (naming file and tensor), an index or data file that resolves outside
            the checkpoint directory (a symlink), or "changed during load" when saves
            replaced the checkpoint three times during one load; on every rank, where the
            ranks found different kinds of checkpoint at their paths, read different
            checkpoints, or asked for different targets.
        SpecError: a target layout with a pending reduction (``Partial``), or a spec that
            does not fit a leaf (naming it).

    Raises for Hugging Face checkpoints: ``CheckpointError`` for a header or index that is
    malformed, oversized or lies about the data (naming file and tensor), for names that
    ``specs``, ``like`` or ``fuse`` give but the checkpoint lacks, and when ranks read
    different files.

    >>> import tempfile, torch, fshard
    >>> x = fshard.shard(torch.arange(8), fshard.Chunk(0, [0, 1, 2, 3]))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fshard.save(d, [x, torch.ones(2)])
    ...     y, t = fshard.load(d, like=[fshard.zeros(fshard.Chunk(0, [0, 1]), 8, dtype=torch.int64), torch.zeros(2)])
    >>> [s.data.tolist() for s in y.addressable_shards], t.tolist()
    ([[0, 1, 2, 3], [4, 5, 6, 7]], [1.0, 1.0])
    """
    if like is not None and specs is not None:
        raise TypeError("load() takes like= or specs=, not both.")
    # Checked at run time too: a caller may pass anything, whatever the annotation says.
    if backend is not None and not isinstance(backend, Backend):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"load() backend= takes an fshard backend or None, got {type(backend).__name__}.")
    hf = {"dtype": dtype, "rename": rename, "fuse": fuse}
    coord = _coordinator(like) or backend or default_backend()
    kind, ranks = _agreed_kind(checkpoint_path(path, "load()"), coord)
    if kind != "fshard":
        return _load_foreign(kind, path, like, specs, hf, backend, progress)
    if any(v is not None for v in hf.values()):
        raise TypeError("load() dtype=, rename= and fuse= apply to Hugging Face checkpoints, not to fshard's own.")
    attempt = lambda: _attempt(path, like, specs, verify, backend, progress, coord)  # noqa: E731
    seen: list[Any] = []
    for _ in range(_ATTEMPTS):
        tree, seen = agree_on(coord, "fshard.load", attempt, lambda out: out[:3])
        if len(set(seen)) == 1 and not seen[0][1]:
            return tree[3]
        if len({s[0] for s in seen}) == 1 and not any(s[1] for s in seen):  # one checkpoint, other targets
            msg = (
                f"fshard.load of {path}: the ranks asked for different targets (like= or specs= differ between "
                "ranks). Every rank must pass the same like= or specs= (load is collective)."
            )
            raise CheckpointError(msg)
    if any(s[1] for s in seen):
        msg = (
            f"Checkpoint {path} changed during load {_ATTEMPTS} times in a row: another process is saving to it. "
            "Load again once that save has finished."
        )
        raise CheckpointError(msg)
    read = _by_value(ranks, [f"index.json sha256 {s[0][:12]}..." for s in seen])
    msg = (
        f"fshard.load of {path}: the ranks read different checkpoints ({read}) in {_ATTEMPTS} attempts: give every "
        "rank the same checkpoint (or load again, if another process was saving to it)."
    )
    raise CheckpointError(msg)


def _by_value(ranks: Sequence[int], values: Sequence[Any]) -> str:
    """Which of ``ranks`` hold each of ``values`` (one per rank): ``ranks [0, 2]: a; ranks [1]: b``."""
    holders: dict[Any, list[int]] = {}
    for r, v in zip(ranks, values):
        holders.setdefault(v, []).append(r)
    return "; ".join(f"ranks {rs}: {v}" for v, rs in holders.items())


_KINDS = {
    "fshard": "an fshard checkpoint (or nothing)",
    "hf-file": "a Hugging Face safetensors file",
    "hf-folder": "a Hugging Face folder",
    "dcp": "a torch DCP folder",
}


def _agreed_kind(root: Path, coord: Backend) -> tuple[str, list[int]]:
    """The kind of checkpoint at ``root`` (``checkpoint_kind``), the same on every rank of ``coord``; and the ranks.

    Each kind's load runs other collectives, so ranks that found different kinds at their
    paths (a path per node, one of them stale) raise here, together, before any of them.
    """
    kind, seen = agree_on(coord, "fshard.load", lambda: checkpoint_kind(root), lambda k: (coord.rank or 0, k))
    ranks = [r for r, _ in seen]
    if len({k for _, k in seen}) > 1:
        found = _by_value(ranks, [_KINDS[k] for _, k in seen])
        msg = f"fshard.load of {root}: the ranks found different kinds of checkpoint there ({found}): give every rank the same checkpoint."  # noqa: E501
        raise CheckpointError(msg)
    return kind, ranks


def _load_foreign(
    kind: str, path: Any, like: Any, specs: Any, hf: dict[str, Any], backend: Backend | None, progress: Any
) -> Any:
    """Another library's checkpoint: a torch DCP folder, or a Hugging Face safetensors file or folder.

    ``hf``: the options of Hugging Face checkpoints only (``dtype``, ``rename``, ``fuse``).
    """
    if kind == "dcp":
        if any(v is not None for v in hf.values()):
            raise TypeError("load() dtype=, rename= and fuse= apply to Hugging Face checkpoints, not to DCP folders.")
        return load_dcp(path, like, specs, backend=backend, progress=progress)
    coord = _coordinator(like) or backend or default_backend()
    return load_hf(
        checkpoint_path(path, "load()"), kind, like, specs, {**hf, "backend": backend, "progress": progress}, coord
    )


# Loads that meet a concurrent save start over (on every rank) at most this many times in all.
_ATTEMPTS = 3


def _coordinator(like: Any) -> Backend | None:
    """The backend of the first array in ``like``: the group that loads together."""
    if isinstance(like, ShardedArray):
        return like.backend
    children: Iterable[Any] = ()
    if isinstance(like, dict):
        children = cast("dict[Any, Any]", like).values()
    elif isinstance(like, (list, tuple)):
        children = cast("Sequence[Any]", like)
    return next((b for b in map(_coordinator, children) if b is not None), None)


def _attempt(
    path: Any, like: Any, specs: Any, verify: Any, backend: Backend | None, progress: Any, coord: Backend
) -> tuple[str, bool, str, Any]:
    """One read of the checkpoint: (index fingerprint, changed under this read, targets' digest, tree or None).

    The tree is ``None`` where a save replaced the index and then deleted files this read needed.
    """
    root = checkpoint_path(path, "load()")
    check_flag("load() verify", verify)
    check_flag("load() progress", progress, optional=True)
    index, fingerprint = read_index(root)
    saved = saved_leaves(root, index)
    targets = _targets(saved, index["tree"], like, specs, backend)
    digest = _targets_digest(targets)
    try:
        values = _read_all(root, index, saved, targets, verify, progress, coord)
    except CheckpointError:
        if _fingerprint(root) != fingerprint:  # a save replaced the index, then deleted files this read needed
            return fingerprint, True, digest, None
        raise
    return fingerprint, False, digest, unflatten(index["tree"], values)


def _targets_digest(targets: Sequence[_Target]) -> str:
    """A digest of what each leaf is read into, alike on ranks that asked for the same (devices aside)."""
    h = hashlib.sha256()
    for t in targets:
        h.update(t.kind.encode())
        if t.layout is not None:
            h.update(layout_digest(t.layout))
    return h.hexdigest()


def _fingerprint(root: Path) -> str | None:
    try:
        return hashlib.sha256((root / INDEX).read_bytes()).hexdigest()
    except OSError:
        return None


def _read_all(
    root: Path,
    index: dict[str, Any],
    saved: list[Saved],
    targets: list[_Target],
    verify: bool,
    progress: Any,
    coord: Backend,
) -> list[Any]:
    total = sum(_target_bytes(s, t) for s, t in zip(saved, targets))
    with contextlib.ExitStack() as stack, progress_bar("fshard.load", total, progress, coord) as bar:
        reader = Reader(root / index["data"], index["files"], verify, stack)
        values = [_read_leaf(s, t, reader, bar) for s, t in zip(saved, targets)]
        reader.check()
        return values


def _target_bytes(saved: Saved, target: _Target) -> int:
    if saved.dtype is None or target.kind == "value":
        return 0
    if target.kind == "tensor" or target.layout is None:
        return math.prod(saved.shape) * saved.dtype.itemsize
    assert target.backend is not None
    return sum(target.layout.shards[i].numel for i in target.backend.addressable(target.layout)) * saved.dtype.itemsize
