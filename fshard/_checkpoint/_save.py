"""``fshard.save``: a pytree of arrays, tensors and scalars to safetensors files plus ``index.json``."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fshard._array.array import ShardedArray
from fshard._checkpoint._agreement import check_same, prepare
from fshard._checkpoint._collective import agree, agree_on
from fshard._checkpoint._format import FORMAT, INDEX, VERSION, check_flag, checkpoint_path, index_digest, plain_scalar
from fshard._checkpoint._lock import save_lock
from fshard._checkpoint._tree import flatten
from fshard._checkpoint._write import Box, assign, check_root, commit, committed, write_files
from fshard._errors import CheckpointError, SpecError
from fshard._exec.collective import collective
from fshard._exec.replicas import check_leaves, checking
from fshard.backends import Backend, default_backend

__all__ = ["save"]


def _save_backend(leaves: Sequence[tuple[str, Any]]) -> Backend:
    backends = {leaf.backend for _, leaf in leaves if isinstance(leaf, ShardedArray)}
    if len(backends) == 1:
        return backends.pop()
    if any(not b.spans_processes for b in backends):
        msg = f"The tree holds arrays on different backends {sorted(b.name for b in backends)}; save them separately."
        raise SpecError(msg)
    return default_backend()


@collective("save")
def save(path: str | os.PathLike[str], tree: Any, *, progress: bool | None = None) -> None:
    """Writes a pytree of ``ShardedArray``s, tensors and scalars to the directory ``path`` (collective).

    Each rank writes one safetensors file with the boxes it owns; a replicated
    box is written once, by the replica that balances bytes across ranks (the
    choice depends only on the layouts, so ranks agree without talking). When
    every rank is done, the first rank writes ``index.json`` atomically. Saving
    over a checkpoint writes a new data directory and swaps the index last: a
    crash at any point leaves the previous checkpoint loadable.

    Before anything is written the ranks compare what they were given: the same
    ``path``, the same tree, and for every plain tensor and scalar the same value
    (tensors by SHA-256). A difference raises ``CheckpointError`` on every rank,
    naming the leaf and the ranks, and leaves the previous checkpoint as it was. In
    check mode the copies of each replicated box are compared too (one is written):
    copies that drifted apart raise ``ReplicaMismatchError`` before anything is written.

    Args:
        path: the checkpoint directory (created; an existing checkpoint there is replaced).
            Every rank must pass the same directory.
        tree: dicts (str or int keys), lists and tuples (nested at most ``MAX_DEPTH``
            levels) of ``ShardedArray``s, plain tensors (one value that every rank
            holds, written by one rank), and ``bool``/``int``/``float``/``str``/``None``.
        progress: show a progress bar (``None``: on a terminal, above ``PROGRESS_MIN_BYTES``).

    Raises:
        TypeError: ``path`` is not a str or an ``os.PathLike``, ``progress`` not a bool or
            ``None``, or a leaf or container cannot be saved (named by its path).
        SpecError: an array with a pending reduction (``Partial``): reshard it first.
        CheckpointError: ``path`` is a file, a foreign directory or lies under a file, or its
            ``index.json`` is not a file; another save holds ``path`` (one save at a time per path);
            writing a file failed (a full disk, a file-size limit: naming the file and the cause);
            ranks gave different paths, trees, plain tensors or scalars; or another rank failed
            (a rank that fails re-raises its own error; the others raise this, naming it). A
            failure after the index is renamed into place fails nothing: the save returns.
        ReplicaMismatchError: in check mode, copies of a replicated box hold different data.

    >>> import tempfile, torch, fshard
    >>> x = fshard.shard(torch.arange(12.0).reshape(3, 4), fshard.Chunk(0, [0, 1, 2]))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fshard.save(d, {"x": x, "step": 7})
    ...     tree = fshard.load(d, specs={"x": fshard.Chunk(1, [0, 1]), "step": None})
    >>> fshard.gather(tree["x"]).equal(fshard.gather(x)), tree["step"]
    (True, 7)
    """
    root = Path()
    leaves: list[tuple[str, Any]] = []
    try:
        root = checkpoint_path(path, "save()")
        check_flag("save() progress", progress, optional=True)
        structure, backend, failure = flatten(tree, "", leaves), _save_backend(leaves), None
    except (TypeError, SpecError, CheckpointError) as exc:  # reported through the first exchange, so no rank waits
        structure, backend, failure = {}, default_backend(), exc
    summarise = lambda: prepare(root, structure, leaves, backend, failure)  # noqa: E731
    (_, summaries, known), seen = agree_on(backend, "fshard.save", summarise, lambda out: out[0])
    check_same(backend, seen, summaries, leaves)
    if checking():  # one copy of each replicated box is written: the copies must agree
        arrays = [(f"the ShardedArray at {p or 'the root'}", a) for p, a in leaves if isinstance(a, ShardedArray)]
        check_leaves(arrays, "fshard.save (nothing was written)")
    ranks, token = [f.rank for f in seen], seen[0].token
    leader = backend.holds(ranks[0])
    holders = ranks if backend.spans_processes else _local_holders(leaves)
    boxes = assign(leaves, holders)
    known_box = {b.name: known[b.leaf] for b in boxes if b.shard is None and b.leaf in known}
    data = root / f"data.{token}"
    with contextlib.ExitStack() as lock:

        def write() -> dict[str, Any]:
            if leader:  # the rank that commits holds the path from before it writes until the old data is gone
                check_root(root, data.name)
                lock.enter_context(save_lock(root))
            return write_files(root, data, leaves, boxes, backend, progress, known_box)

        try:
            files = {k: v for w in agree(backend, "fshard.save", write, share=True) for k, v in w.items()}
            write_index = lambda: commit(root, index_record(structure, leaves, boxes, files, data.name), token)  # noqa: E731
            agree(backend, "fshard.save (index)", write_index if leader else lambda: None)
        except BaseException as exc:
            if committed(root, data.name):
                # The rename is the commit: a failure after it (the leader killed or failing while it
                # tidies up, which the others see as a lost peer) fails nothing. Interrupts still propagate.
                if isinstance(exc, Exception):
                    return
                raise
            if leader:
                shutil.rmtree(data, ignore_errors=True)
                with contextlib.suppress(OSError):
                    (root / f"{INDEX}.{token}.tmp").unlink(missing_ok=True)
            raise


def _local_holders(leaves: Sequence[tuple[str, Any]]) -> list[int]:
    ranks = sorted({r for _, leaf in leaves if isinstance(leaf, ShardedArray) for r in leaf.layout.ranks})
    return ranks or [0]


def index_record(
    structure: dict[str, Any],
    leaves: Sequence[tuple[str, Any]],
    boxes: Sequence[Box],
    files: dict[str, Any],
    data: str,
) -> dict[str, Any]:
    """The ``index.json`` content (with its digest) of a save that wrote ``boxes`` into ``files`` under ``data``."""
    hashes = {n: h for f in files.values() for n, h in f["sha256"].items()}
    by_leaf: dict[int, list[Box]] = {}
    for b in boxes:
        by_leaf.setdefault(b.leaf, []).append(b)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "data": data,
        "files": {k: {"rank": v["rank"], "bytes": v["bytes"]} for k, v in sorted(files.items())},
        "tree": structure,
        "leaves": [_leaf_record(p, leaf, by_leaf.get(i, []), hashes) for i, (p, leaf) in enumerate(leaves)],
    }
    return {**index, "digest": index_digest(index)}


def _leaf_record(path: str, leaf: Any, boxes: Sequence[Box], hashes: dict[str, str]) -> dict[str, Any]:
    if not isinstance(leaf, (ShardedArray, torch.Tensor)):
        kind, value = plain_scalar(leaf)
        return {"path": path, "kind": "scalar", "type": kind.__name__, "value": repr(value) if kind is float else value}
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
