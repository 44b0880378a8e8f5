"""Checkpoints: a pytree of arrays, tensors and scalars as safetensors files plus one JSON index.

On disk (format 1, described for other readers in docs/checkpoints.md)::

    path/index.json                              written last, atomically: the commit point
    path/data.<id>/rank-00003.safetensors        the boxes rank 3 wrote

Each distinct box is written once, by the replica that balances bytes across
ranks. ``load`` reads, per target shard on this process, only the byte ranges of
the saved boxes that overlap it (a whole saved box when it verifies hashes). No
pickle is written or read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fshard._array import ShardedArray
from fshard._errors import CheckpointError, FShardError, LayoutError, SpecError
from fshard._layout import Layout, ShardMeta
from fshard._placement import Placement
from fshard._plan import plan
from fshard._specs import as_layout
from fshard.backends import Backend, default_backend
from fshard.backends.local import new_shard

__all__ = ["FORMAT", "INDEX", "PROGRESS_MIN_BYTES", "VERSION", "checkpoint_info", "load", "save"]

FORMAT = "fshard-checkpoint"
VERSION = 1
INDEX = "index.json"
# Saves and loads that move at least this many bytes show a progress bar on a terminal.
PROGRESS_MIN_BYTES = 256 << 20

_DATA_RE = re.compile(r"^data\.[0-9a-f]{32}$")
_FILE_RE = re.compile(r"^rank-\d{5,}\.safetensors$")
_TMP_RE = re.compile(r"^index\.json\.[0-9a-f]{32}\.tmp$")
# torch dtype -> safetensors dtype code, for every dtype both sides know.
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}  # fmt: skip
_DTYPES = {str(d).removeprefix("torch."): d for d in _CODES}
_SCALARS = (bool, int, float, str, type(None))
_CPU = torch.device("cpu")


# -- pytree structure as JSON -------------------------------------------------------------


def _flatten(tree: Any, path: str, leaves: list[tuple[str, Any]]) -> dict[str, Any]:
    """The JSON structure of ``tree`` (dicts, lists, tuples); appends ``(path, leaf)`` pairs."""
    if type(tree) in (dict, collections.OrderedDict):
        for k in tree:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                msg = f"Dict key {k!r} at {path or 'the root'} is a {type(k).__name__}; use str or int keys."
                raise TypeError(msg)
        return {"dict": [[k, _flatten(v, f"{path}[{k!r}]", leaves)] for k, v in tree.items()]}
    if type(tree) in (list, tuple):
        kind = type(tree).__name__
        return {kind: [_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(tree)]}
    if isinstance(tree, (dict, list, tuple)):
        msg = (
            f"{type(tree).__name__} at {path or 'the root'} is not a plain dict, list or tuple; "
            "convert it first (a namedtuple with ._asdict(), a custom mapping with dict(...))."
        )
        raise TypeError(msg)
    leaves.append((path, tree))
    return {"leaf": len(leaves) - 1}


def _unflatten(node: dict[str, Any], values: Sequence[Any]) -> Any:
    if "leaf" in node:
        return values[node["leaf"]]
    if "dict" in node:
        return {k: _unflatten(v, values) for k, v in node["dict"]}
    kind = "list" if "list" in node else "tuple"
    return (list if kind == "list" else tuple)(_unflatten(v, values) for v in node[kind])


def _leaf_indices(node: dict[str, Any]) -> Iterator[int]:
    if "leaf" in node:
        yield node["leaf"]
        return
    children = [c for _, c in node["dict"]] if "dict" in node else node["list" if "list" in node else "tuple"]
    for child in children:
        yield from _leaf_indices(child)


def _describe_node(node: dict[str, Any]) -> str:
    if "leaf" in node:
        return "a leaf"
    if "dict" in node:
        return f"a dict with keys {[k for k, _ in node['dict']]}"
    kind = "list" if "list" in node else "tuple"
    return f"a {kind} of {len(node[kind])}"


def _match(node: dict[str, Any], tree: Any, path: str, out: dict[int, Any], *, prefix: bool) -> None:
    """Pairs each saved leaf with the entry of ``tree`` at the same place (``prefix``: a leaf covers a subtree)."""
    if "leaf" in node or (prefix and not isinstance(tree, (dict, list, tuple))):
        out.update(dict.fromkeys(_leaf_indices(node), tree))
        return
    where = path or "the root"
    if "dict" in node and isinstance(tree, dict):
        keys = [k for k, _ in node["dict"]]
        if set(keys) != set(tree):
            msg = (
                f"Tree structure differs at {where}: the checkpoint has keys {keys}, the given tree "
                f"{list(tree)} (missing {[k for k in keys if k not in tree]}, extra "
                f"{[k for k in tree if k not in keys]}): pass a tree shaped like the saved one."
            )
            raise CheckpointError(msg)
        for k, child in node["dict"]:
            _match(child, tree[k], f"{path}[{k!r}]", out, prefix=prefix)
        return
    kind = "list" if "list" in node else "tuple" if "tuple" in node else None
    if kind is None or type(tree).__name__ != kind or len(tree) != len(node[kind]):
        got = f"a {type(tree).__name__}" + (f" of {len(tree)}" if isinstance(tree, (list, tuple, dict)) else "")
        msg = (
            f"Tree structure differs at {where}: the checkpoint has {_describe_node(node)}, the given tree {got}; "
            "pass a tree shaped like the saved one (fshard.checkpoint_info(path) shows it)."
        )
        raise CheckpointError(msg)
    for i, child in enumerate(node[kind]):
        _match(child, tree[i], f"{path}[{i}]", out, prefix=prefix)


# -- what gets written where ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Box:
    """One box written once: its leaf, extent, writer (rank and shard index) and tensor name."""

    leaf: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    shard: int | None
    name: str

    @property
    def file(self) -> str:
        return _file_name(self.rank)


def _file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _box_text(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return ",".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes))


def _check_leaf(path: str, leaf: Any) -> None:
    where = path or "the root"
    if isinstance(leaf, ShardedArray):
        dtype = leaf.dtype
    elif type(leaf) in (torch.Tensor, torch.nn.Parameter):
        dtype = leaf.dtype
        if leaf.layout != torch.strided:
            raise TypeError(f"Tensor at {where} has layout {leaf.layout}; checkpoints take strided tensors.")
    elif isinstance(leaf, torch.Tensor):
        msg = (
            f"{type(leaf).__name__} at {where} is a tensor subclass; convert it to a ShardedArray first "
            "(fshard.from_dtensor, fshard.from_sharded_tensor) or pass a plain tensor."
        )
        raise TypeError(msg)
    elif isinstance(leaf, _SCALARS):
        return
    else:
        msg = (
            f"{type(leaf).__name__} at {where} cannot be saved: leaves are ShardedArrays, tensors, "
            "bool, int, float, str or None."
        )
        raise TypeError(msg)
    if dtype not in _CODES:
        raise TypeError(f"Leaf at {where} has dtype {dtype}; checkpoints store {sorted(_DTYPES)}.")


def _distinct(layout: Layout) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]:
    """Each distinct non-empty box of ``layout`` and the shards (replicas) holding it, in layout order."""
    out: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, s in enumerate(layout.shards):
        if s.numel:
            out.setdefault((s.offsets, s.sizes), []).append(i)
    return out


def _assign(leaves: Sequence[tuple[str, Any]], holders: Sequence[int]) -> list[_Box]:
    """Chooses one writer per distinct box: largest boxes first, each to its least-loaded replica.

    A pure function of the layouts, shapes and dtypes, so every rank computes the
    same answer without communication. Plain tensors may go to any of ``holders``.
    """
    items = []
    for li, (_, leaf) in enumerate(leaves):
        if isinstance(leaf, ShardedArray):
            shards = leaf.layout.shards
            for k, (box, idx) in enumerate(_distinct(leaf.layout).items()):
                items.append((li, k, box, leaf.dtype.itemsize, [(shards[i].placement.rank, i) for i in idx]))
        elif isinstance(leaf, torch.Tensor) and leaf.numel():
            box = ((0,) * leaf.ndim, tuple(leaf.shape))
            items.append((li, 0, box, leaf.dtype.itemsize, [(r, None) for r in holders]))
    load: dict[int, int] = {}
    boxes = []
    for li, _, (lo, sz), item, who in sorted(items, key=lambda t: (-math.prod(t[2][1]) * t[3], t[0], t[1])):
        rank, shard = min(who, key=lambda c: (load.get(c[0], 0), c[0], c[1] or 0))
        load[rank] = load.get(rank, 0) + math.prod(sz) * item
        boxes.append(_Box(li, lo, sz, rank, shard, f"{leaves[li][0]}@{_box_text(lo, sz)}"))
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


def _box_data(box: _Box, held: dict[int | None, torch.Tensor], backend: Backend) -> torch.Tensor | None:
    """This process's tensor for ``box`` if it is the box's writer, else ``None``."""
    if box.shard is None and backend.rank not in (None, box.rank):
        return None
    t = held.get(box.shard)
    return None if t is None else t.detach().to("cpu").contiguous()


def _bytes_of(t: torch.Tensor) -> Any:
    return t.reshape(-1).view(torch.uint8).numpy()


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes_of(t)).hexdigest()


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every one whose memory overlaps an earlier one copied (safetensors refuses overlap)."""
    out, end = dict(tensors), -1
    for lo, hi, name in sorted((t.data_ptr(), t.data_ptr() + t.nbytes, n) for n, t in tensors.items() if t.nbytes):
        if lo < end:
            out[name] = tensors[name].clone()
        else:
            end = hi
    return out


# -- the files ------------------------------------------------------------------------------


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError:  # some platforms cannot fsync a directory; the rename is still atomic there
        if not directory:
            raise
    finally:
        os.close(fd)


def _check_root(root: Path) -> None:
    """Refuses to write into a path that holds something other than an fshard checkpoint."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"Checkpoint path {root} exists and is not a directory: save to a directory path.")
    if root.is_dir() and not (root / INDEX).exists():
        foreign = sorted(p.name for p in root.iterdir() if not (_DATA_RE.match(p.name) or _TMP_RE.match(p.name)))
        if foreign:
            msg = (
                f"Checkpoint path {root} is a non-empty directory without {INDEX} (it holds {foreign[:3]}): "
                "save to a new or empty directory, or to an existing fshard checkpoint to replace it."
            )
            raise CheckpointError(msg)


def _write_files(
    root: Path, data: Path, leaves: Sequence[tuple[str, Any]], boxes: Sequence[_Box], backend: Backend, progress: Any
) -> dict[str, dict[str, Any]]:
    """Writes this process's files (fsynced); returns, per file, its rank, size and tensor hashes."""
    _check_root(root)
    per_file: dict[int, dict[str, torch.Tensor]] = {}
    held = _held(leaves, backend)
    for box in boxes:
        t = _box_data(box, held[box.leaf], backend)
        if t is not None:
            per_file.setdefault(box.rank, {})[box.name] = t
    data.mkdir(parents=True, exist_ok=True)
    written = {}
    total = sum(t.nbytes for d in per_file.values() for t in d.values())
    with _progress("fshard.save", total, progress, backend) as bar, _hashing() as pool:
        files = sorted(per_file.items())
        hashes = [{n: pool.submit(_sha256, t) for n, t in tensors.items()} for _, tensors in files]
        synced = []
        for (rank, tensors), digests in zip(files, hashes):
            target = data / _file_name(rank)
            save_file(_unshared(tensors), str(target), metadata={"format": FORMAT, "rank": str(rank)})
            synced.append(pool.submit(_fsync, target))  # flushes while the next file is written
            sha = {n: f.result() for n, f in digests.items()}
            written[target.name] = {"rank": rank, "bytes": target.stat().st_size, "sha256": sha}
            bar.update(sum(t.nbytes for t in tensors.values()))
        for f in synced:
            f.result()
    _fsync(data, directory=True)  # the files' directory entries, before an index can name them
    return written


@contextlib.contextmanager
def _hashing() -> Iterator[ThreadPoolExecutor]:
    """Threads for SHA-256 (hashlib releases the GIL), so hashing overlaps writes, reads and copies."""
    with ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="fshard-sha256") as pool:
        yield pool


def _leaf_record(path: str, leaf: Any, boxes: Sequence[_Box], hashes: dict[str, str]) -> dict[str, Any]:
    if not isinstance(leaf, (ShardedArray, torch.Tensor)):
        value = repr(leaf) if isinstance(leaf, float) else leaf
        return {"path": path, "kind": "scalar", "type": type(leaf).__name__, "value": value}
    record: dict[str, Any] = {
        "path": path,
        "kind": "array" if isinstance(leaf, ShardedArray) else "tensor",
        "dtype": str(leaf.dtype).removeprefix("torch."),
        "shape": list(leaf.shape),
    }
    if isinstance(leaf, ShardedArray):
        record["layout"] = leaf.layout.to_dict()
    record["boxes"] = [
        {"offsets": list(b.offsets), "sizes": list(b.sizes), "file": b.file, "tensor": b.name, "sha256": hashes[b.name]}
        for b in boxes
    ]
    return record


def _commit(root: Path, index: dict[str, Any], token: str) -> None:
    """Writes ``index.json`` atomically (temporary file, fsync, rename), then drops older data."""
    tmp = root / f"{INDEX}.{token}.tmp"
    _fsync(root, directory=True)  # the data directory's entry, before the index that names it
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / INDEX)
    _fsync(root, directory=True)
    for p in root.iterdir():
        if _DATA_RE.match(p.name) and p.name != index["data"]:
            shutil.rmtree(p, ignore_errors=True)
        elif _TMP_RE.match(p.name):
            p.unlink(missing_ok=True)


def _agree(backend: Backend, what: str, fn: Callable[[], Any], *, share: bool = False) -> Any:
    """Runs ``fn`` here, then tells every rank whether it failed anywhere: all ranks raise, none hangs.

    Returns ``fn``'s result, or with ``share`` every rank's result (one exchange either way).
    """
    try:
        out, error = fn(), None
    except Exception as exc:
        out, error = None, exc
    problem = None if error is None else f"{type(error).__name__}: {error}"
    seen = backend.exchange((backend.rank, problem, out if share else None))
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg, _ in seen if msg is not None]
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")
    return [o for _, _, o in seen] if share else out


def _save_backend(leaves: Sequence[tuple[str, Any]]) -> Backend:
    backends = {leaf.backend for _, leaf in leaves if isinstance(leaf, ShardedArray)}
    if len(backends) == 1:
        return backends.pop()
    if any(b.rank is None for b in backends):
        msg = f"The tree holds arrays on different backends {sorted(b.name for b in backends)}; save them separately."
        raise SpecError(msg)
    return default_backend()


def save(path: str | os.PathLike[str], tree: Any, *, progress: bool | None = None) -> None:
    """Writes a pytree of ``ShardedArray``s, tensors and scalars to the directory ``path`` (collective).

    Each rank writes one safetensors file with the boxes it owns; a replicated
    box is written once, by the replica that balances bytes across ranks (the
    choice depends only on the layouts, so ranks agree without talking). When
    every rank is done, the first rank writes ``index.json`` atomically. Saving
    over a checkpoint writes a new data directory and swaps the index last: a
    crash at any point leaves the previous checkpoint loadable.

    Args:
        path: the checkpoint directory (created; an existing checkpoint there is replaced).
        tree: dicts (str or int keys), lists and tuples of ``ShardedArray``s, plain
            tensors (written by one rank), and ``bool``/``int``/``float``/``str``/``None``.
        progress: show a progress bar (``None``: on a terminal, above ``PROGRESS_MIN_BYTES``).

    Raises:
        TypeError: a leaf or container that cannot be saved (named by its path).
        CheckpointError: ``path`` is a file or a foreign directory, or another rank failed
            (a rank that fails re-raises its own error; the others raise this, naming it).

    >>> import tempfile, torch, fshard
    >>> x = fshard.shard(torch.arange(12.0).reshape(3, 4), fshard.Chunk(0, [0, 1, 2]))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fshard.save(d, {"x": x, "step": 7})
    ...     tree = fshard.load(d, specs={"x": fshard.Chunk(1, [0, 1]), "step": None})
    >>> fshard.gather(tree["x"]).equal(fshard.gather(x)), tree["step"]
    (True, 7)
    """
    root = Path(path)
    leaves: list[tuple[str, Any]] = []
    structure = _flatten(tree, "", leaves)
    for p, leaf in leaves:
        _check_leaf(p, leaf)
    backend = _save_backend(leaves)
    seen = backend.exchange((backend.rank, uuid.uuid4().hex))
    ranks, token = [r for r, _ in seen], seen[0][1]
    leader = backend.rank is None or backend.rank == ranks[0]
    holders = ranks if backend.rank is not None else _local_holders(leaves)
    boxes = _assign(leaves, holders)
    data = root / f"data.{token}"
    try:
        write = lambda: _write_files(root, data, leaves, boxes, backend, progress)  # noqa: E731
        files = {k: v for w in _agree(backend, "fshard.save", write, share=True) for k, v in w.items()}
        commit = lambda: _commit(root, _index(structure, leaves, boxes, files, data.name), token)  # noqa: E731
        _agree(backend, "fshard.save (index)", commit if leader else lambda: None)
    except BaseException:
        if leader and not _committed(root, data.name):
            shutil.rmtree(data, ignore_errors=True)
            with contextlib.suppress(OSError):
                (root / f"{INDEX}.{token}.tmp").unlink(missing_ok=True)
        raise


def _committed(root: Path, data: str) -> bool:
    """Whether the index on disk names the data directory ``data``."""
    try:
        return json.loads((root / INDEX).read_text(encoding="utf-8")).get("data") == data
    except (OSError, ValueError, AttributeError):
        return False


def _local_holders(leaves: Sequence[tuple[str, Any]]) -> list[int]:
    ranks = sorted({r for _, leaf in leaves if isinstance(leaf, ShardedArray) for r in leaf.layout.ranks})
    return ranks or [0]


def _index(
    structure: dict[str, Any],
    leaves: Sequence[tuple[str, Any]],
    boxes: Sequence[_Box],
    files: dict[str, Any],
    data: str,
) -> dict[str, Any]:
    hashes = {n: h for f in files.values() for n, h in f["sha256"].items()}
    by_leaf: dict[int, list[_Box]] = {}
    for b in boxes:
        by_leaf.setdefault(b.leaf, []).append(b)
    return {
        "format": FORMAT,
        "version": VERSION,
        "data": data,
        "files": {k: {"rank": v["rank"], "bytes": v["bytes"]} for k, v in sorted(files.items())},
        "tree": structure,
        "leaves": [_leaf_record(p, leaf, by_leaf.get(i, []), hashes) for i, (p, leaf) in enumerate(leaves)],
    }


# -- reading ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Saved:
    """One leaf of the index, checked."""

    path: str
    kind: str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    layout: Layout | None = None
    boxes: tuple[dict[str, Any], ...] = ()
    value: Any = None

    @property
    def where(self) -> str:
        return self.path or "the root"


def _read_index(root: Path) -> dict[str, Any]:
    where = root / INDEX
    if not where.is_file():
        hint = " (an interrupted save leaves no index)" if root.is_dir() else ""
        raise CheckpointError(f"{where} does not exist{hint}: {root} is not an fshard checkpoint.")
    try:
        index = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where} is not valid JSON ({exc}); the checkpoint index is damaged.") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not an fshard checkpoint index (no 'format': {FORMAT!r}).")
    if index.get("version") != VERSION:
        msg = f"{where} has format version {index.get('version')!r}; this fshard reads {VERSION}: upgrade fshard."
        raise CheckpointError(msg)
    if not _DATA_RE.match(str(index.get("data"))):
        raise CheckpointError(f"{where} names data directory {index.get('data')!r}, not 'data.<32 hex digits>'.")
    return index


def _saved_leaves(root: Path, index: dict[str, Any]) -> list[_Saved]:
    try:
        out = [_parse_leaf(r, index["files"]) for r in index["leaves"]]
        if sorted(_leaf_indices(index["tree"])) != list(range(len(out))):
            raise CheckpointError("its tree does not name each leaf exactly once")
    except (KeyError, TypeError, ValueError, AttributeError, FShardError) as exc:
        raise CheckpointError(f"{root / INDEX} is malformed: {exc!r}. The checkpoint index is damaged.") from exc
    return out


def _parse_leaf(record: dict[str, Any], files: dict[str, Any]) -> _Saved:
    kind, path = record["kind"], str(record["path"])
    if kind == "scalar":
        types = {"bool": bool, "int": int, "float": float, "str": str, "NoneType": type(None)}
        value = float(record["value"]) if record["type"] == "float" else record["value"]
        if not isinstance(value, types[record["type"]]):
            raise CheckpointError(f"scalar {path} holds {value!r}, not a {record['type']}")
        return _Saved(path, kind, value=value)
    if kind not in ("array", "tensor") or record["dtype"] not in _DTYPES:
        raise CheckpointError(f"leaf {path} has kind {kind!r} and dtype {record.get('dtype')!r}")
    shape = tuple(int(s) for s in record["shape"])
    layout = Layout.from_dict(record["layout"]) if kind == "array" else None
    for b in record["boxes"]:
        if b["file"] not in files or not _FILE_RE.match(b["file"]) or len(b["sha256"]) != 64:
            raise CheckpointError(f"leaf {path} has a box in unknown file {b['file']!r}")
    return _Saved(path, kind, _DTYPES[record["dtype"]], shape, layout, tuple(record["boxes"]))


@dataclasses.dataclass(frozen=True)
class _Target:
    """What to build for one leaf: a ShardedArray in ``layout`` on ``backend``, a tensor, or the value."""

    kind: str
    layout: Layout | None = None
    backend: Any = None
    device: torch.device = _CPU
    requires_grad: bool = False


def _mismatch(saved: _Saved, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"Leaf {saved.where} of the checkpoint {what}: {fix}.")


def _target_like(saved: _Saved, like: Any) -> _Target:
    if saved.kind == "scalar":
        if type(like) is not type(saved.value):
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
        return _Target("array", like.layout, like.backend, requires_grad=like.requires_grad)
    return _Target("tensor", device=like.device, requires_grad=like.requires_grad)


def _target_spec(saved: _Saved, spec: Any, backend: Backend | None) -> _Target:
    if saved.kind == "scalar":
        return _Target("value")
    if spec is None:
        return _Target("tensor")
    b = default_backend() if backend is None else backend
    layout = as_layout(spec, saved.shape)
    b.check_layout(layout)
    return _Target("array", layout, b)


def _target_saved(saved: _Saved, backend: Backend | None) -> _Target:
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


class _Reader:
    """Opens checkpoint files on first use; reads, checks and verifies boxes."""

    def __init__(self, data: Path, files: dict[str, Any], verify: bool, stack: contextlib.ExitStack) -> None:
        self.data, self.files, self.verify, self.stack = data, files, verify, stack
        self.open: dict[str, Any] = {}
        self.pool = stack.enter_context(_hashing()) if verify else None
        self.pending: list[tuple[Future[str], dict[str, Any], _Saved]] = []

    def _handle(self, box: dict[str, Any], saved: _Saved) -> Any:
        name = box["file"]
        if name not in self.open:
            path = self.data / name
            tensor = box["tensor"]
            if not path.is_file():
                msg = f"Checkpoint file {path} is missing (it holds tensor {tensor!r} of leaf {saved.where})."
                raise CheckpointError(msg)
            size, want = path.stat().st_size, self.files[name]["bytes"]
            if size != want:
                msg = (
                    f"Checkpoint file {path} has {size} bytes, index.json records {want}: it was truncated or "
                    f"replaced (needed for tensor {tensor!r} of leaf {saved.where})."
                )
                raise CheckpointError(msg)
            try:
                self.open[name] = self.stack.enter_context(safe_open(str(path), framework="pt"))
            except SafetensorError as exc:
                raise CheckpointError(f"Checkpoint file {path} is not a readable safetensors file: {exc}.") from exc
        return self.open[name]

    def _slice(self, box: dict[str, Any], saved: _Saved) -> Any:
        path, name = self.data / box["file"], box["tensor"]
        try:
            part = self._handle(box, saved).get_slice(name)
            code, shape = part.get_dtype(), tuple(part.get_shape())
        except SafetensorError as exc:
            msg = f"Checkpoint file {path} has no readable tensor {name!r} (leaf {saved.where}): {exc}."
            raise CheckpointError(msg) from exc
        assert saved.dtype is not None
        if code != _CODES[saved.dtype] or shape != tuple(box["sizes"]):
            msg = (
                f"Checkpoint file {path}: tensor {name!r} is {code} of shape {shape}, index.json records "
                f"{_CODES[saved.dtype]} of shape {tuple(box['sizes'])}: the file does not belong to this index."
            )
            raise CheckpointError(msg)
        return part

    def whole(self, box: dict[str, Any], saved: _Saved) -> torch.Tensor:
        """The whole saved box; its sha256 is checked against the index in a thread (see ``check``)."""
        self._slice(box, saved)
        t = self.open[box["file"]].get_tensor(box["tensor"])
        assert self.pool is not None
        self.pending.append((self.pool.submit(_sha256, t), box, saved))
        return t

    def check(self) -> None:
        """Waits for the hashes of every box read so far; raises for the first that does not match."""
        for future, box, saved in self.pending:
            if future.result() != box["sha256"]:
                msg = (
                    f"Checkpoint file {self.data / box['file']}: tensor {box['tensor']!r} (leaf {saved.where}) does "
                    "not match the sha256 in index.json: the file was modified or corrupted. Restore it, or re-save."
                )
                raise CheckpointError(msg)
        self.pending.clear()

    def part(self, box: dict[str, Any], saved: _Saved, index: tuple[slice, ...]) -> torch.Tensor:
        """Only the elements of ``index`` (relative to the saved box)."""
        part = self._slice(box, saved)
        try:
            return part[index] if index else self.open[box["file"]].get_tensor(box["tensor"])
        except SafetensorError as exc:
            msg = f"Checkpoint file {self.data / box['file']}: reading tensor {box['tensor']!r} failed: {exc}."
            raise CheckpointError(msg) from exc


def _slices(lo: Sequence[int], size: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a - o, a - o + n) for a, n, o in zip(lo, size, origin))


def _source_layout(saved: _Saved) -> Layout:
    """The written boxes as a layout (box k on "rank" k), so ``plan`` finds the overlaps."""
    shards = tuple(ShardMeta(tuple(b["offsets"]), tuple(b["sizes"]), Placement(k)) for k, b in enumerate(saved.boxes))
    try:
        return Layout(saved.shape, shards)
    except LayoutError as exc:
        raise CheckpointError(f"index.json boxes of leaf {saved.where} do not tile shape {saved.shape}: {exc}") from exc


def _fill(saved: _Saved, layout: Layout, out: dict[int, torch.Tensor], reader: _Reader, bar: Any) -> None:
    """Writes the saved values into the shards ``out`` (indices into ``layout``), reading only overlaps."""
    if not out or layout.numel == 0:
        return
    p = plan(_source_layout(saved), layout)
    rows: dict[int, list[int]] = {}
    for k, j in enumerate(p.dst_shard.tolist()):
        if j in out:
            rows.setdefault(int(p.src_shard[k]), []).append(k)
    for src, ks in rows.items():
        box = saved.boxes[src]
        whole = reader.whole(box, saved) if reader.verify else None
        for k in ks:
            lo, size, j = p.lo[k].tolist(), p.size[k].tolist(), int(p.dst_shard[k])
            read = _slices(lo, size, box["offsets"])
            piece = whole[read] if whole is not None else reader.part(box, saved, read)
            out[j][_slices(lo, size, layout.shards[j].offsets)].copy_(piece)
            bar.update(piece.nbytes)


def _read_leaf(saved: _Saved, target: _Target, reader: _Reader, bar: Any) -> Any:
    if target.kind == "value":
        return saved.value
    assert saved.dtype is not None
    if target.kind == "tensor":
        layout = Layout(saved.shape, (ShardMeta((0,) * len(saved.shape), saved.shape, Placement(0)),))
        index: tuple[int, ...] = (0,)
    else:
        assert target.layout is not None
        layout, index = target.layout, target.backend.addressable(target.layout)
    # Replicas on this process are read once and copied.
    boxes = {i: (layout.shards[i].offsets, layout.shards[i].sizes) for i in index}
    first: dict[tuple[Any, ...], int] = {}
    for i in index:
        first.setdefault(boxes[i], i)
    out = {i: _new(layout, i, saved.dtype, target) for i in first.values()}
    _fill(saved, layout, out, reader, bar)
    data = [out[i] if i in out else out[first[boxes[i]]].clone() for i in index]
    data = [t.requires_grad_() if target.requires_grad else t for t in data]
    if target.kind == "tensor":
        return data[0]
    return ShardedArray(layout, data, target.backend, saved.dtype)


def _new(layout: Layout, i: int, dtype: torch.dtype, target: _Target) -> torch.Tensor:
    device = target.device if target.kind == "tensor" else torch.device(layout.shards[i].placement.device)
    if device.type == "cpu":  # recycled memory where a dead array left some, as for reshard's outputs
        return new_shard(layout, i, torch.empty(0, dtype=dtype))
    return torch.empty(layout.shards[i].sizes, dtype=dtype, device=device)


def _targets(
    saved: list[_Saved], tree: dict[str, Any], like: Any, specs: Any, backend: Backend | None
) -> list[_Target]:
    given: dict[int, Any] = {}
    if like is not None:
        _match(tree, like, "", given, prefix=False)
        return [_target_like(s, given[i]) for i, s in enumerate(saved)]
    if specs is not None:
        _match(tree, specs, "", given, prefix=True)
        return [_target_spec(s, given[i], backend) for i, s in enumerate(saved)]
    return [_target_saved(s, backend) for s in saved]


def load(
    path: str | os.PathLike[str],
    like: Any = None,
    specs: Any = None,
    *,
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

    Args:
        path: a directory written by ``fshard.save``.
        like: a tree shaped like the saved one: a ``ShardedArray`` leaf gives the
            target layout and backend, a tensor gives a plain tensor (on its
            device); shapes and dtypes must match the saved ones.
        specs: instead of ``like``: a tree of specs or ``Layout``s (``None`` for a
            plain tensor). A spec where the checkpoint has a subtree applies to
            every tensor in it; scalars ignore their spec.
        verify: check per-box sha256 hashes.
        backend: for ``specs`` (and for neither): the backend of the new arrays
            (default: torch_dist when initialised, else local). Without ``like``
            or ``specs``, arrays come back in their saved layouts.
        progress: show a progress bar (``None``: on a terminal, above ``PROGRESS_MIN_BYTES``).

    Returns:
        The saved tree (dicts, lists, tuples) with arrays in the target layouts.

    Raises:
        CheckpointError: a missing index or file, a truncated or tampered file,
            or a tree, shape or dtype that does not match; naming file and tensor.

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
    root = Path(path)
    index = _read_index(root)
    saved = _saved_leaves(root, index)
    targets = _targets(saved, index["tree"], like, specs, backend)
    coord = next((t.backend for t in targets if t.kind == "array"), None) or (backend or default_backend())
    values = _agree(coord, "fshard.load", lambda: _read_all(root, index, saved, targets, verify, progress, coord))
    return _unflatten(index["tree"], values)


def _read_all(
    root: Path,
    index: dict[str, Any],
    saved: list[_Saved],
    targets: list[_Target],
    verify: bool,
    progress: Any,
    coord: Backend,
) -> list[Any]:
    total = sum(_target_bytes(s, t) for s, t in zip(saved, targets))
    with contextlib.ExitStack() as stack, _progress("fshard.load", total, progress, coord) as bar:
        reader = _Reader(root / index["data"], index["files"], verify, stack)
        values = [_read_leaf(s, t, reader, bar) for s, t in zip(saved, targets)]
        reader.check()
        return values


def _target_bytes(saved: _Saved, target: _Target) -> int:
    if saved.dtype is None or target.kind == "value":
        return 0
    if target.kind == "tensor" or target.layout is None:
        return math.prod(saved.shape) * saved.dtype.itemsize
    return sum(target.layout.shards[i].numel for i in target.backend.addressable(target.layout)) * saved.dtype.itemsize


# -- progress and info -------------------------------------------------------------------------


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def _progress(desc: str, total: int, enabled: bool | None, backend: Backend) -> Iterator[Any]:
    """A tqdm bar on the first rank, if tqdm is installed and ``enabled`` (``None``: a terminal and a big job)."""
    show = enabled if enabled is not None else (total >= PROGRESS_MIN_BYTES and sys.stderr.isatty())
    tqdm = None
    if show and backend.rank in (None, 0):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
    if tqdm is None:
        yield _NoBar()
        return
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False) as bar:
        yield bar


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def checkpoint_info(path: str | os.PathLike[str]) -> str:
    """A description of what a checkpoint holds: tree, shapes, dtypes, files and layout pictures.

    Reads only ``index.json``.

    Raises:
        CheckpointError: ``path`` holds no readable index.

    >>> import tempfile, torch, fshard
    >>> x = fshard.shard(torch.zeros(4, 6), fshard.Chunk(0, [0, 1]))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fshard.save(d, {"w": x, "lr": 0.1})
    ...     print(fshard.checkpoint_info(d).split("\\n", 1)[1])
    ['w']: array float32 (4, 6), 2 boxes written
      +-----------------------+
      |          r0           |
      +-----------------------+
      |          r1           |
      +-----------------------+
    ['lr']: float = 0.1
    files: rank-00000.safetensors (...), rank-00001.safetensors (...)
    """
    root = Path(path)
    index = _read_index(root)
    saved = _saved_leaves(root, index)
    total = sum(f["bytes"] for f in index["files"].values())
    files = len(index["files"])
    lines = [f"fshard checkpoint {root} (format {VERSION}): {len(saved)} leaves, {_human(total)} in {files} files"]
    for s in saved:
        lines.extend(_describe_leaf(s))
    lines.append("files: " + ", ".join(f"{k} ({_human(v['bytes'])})" for k, v in index["files"].items()))
    return "\n".join(lines)


def _describe_leaf(s: _Saved) -> list[str]:
    if s.kind == "scalar":
        return [f"{s.where}: {type(s.value).__name__} = {s.value!r}"]
    dtype = str(s.dtype).removeprefix("torch.")
    head = f"{s.where}: {s.kind} {dtype} {s.shape}, {len(s.boxes)} box{'es' if len(s.boxes) != 1 else ''} written"
    if s.layout is None:
        return [head]
    return [head, *("  " + line for line in s.layout.visualize(width=24).splitlines())]
