"""``fshard.save_safetensors``: a flat tree of arrays and tensors as a Hugging Face safetensors folder."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fshard._array.array import ShardedArray
from fshard._checkpoint._agreement import check_same, prepare
from fshard._checkpoint._collective import agree, agree_on
from fshard._checkpoint._format import NESTED, checkpoint_path
from fshard._checkpoint._hf_commit import check_target, commit, discard, stage_for, writing
from fshard._checkpoint._hf_direct import create_files, write_boxes
from fshard._checkpoint._hf_write import METADATA_KEY, file_names, parse_size, shard_files, write_order
from fshard._checkpoint._lock import save_lock
from fshard._errors import CheckpointError, SpecError
from fshard._exec.collective import collective
from fshard.backends import Backend, default_backend

__all__ = ["save_safetensors"]


@collective("save_safetensors")
def save_safetensors(path: str | os.PathLike[str], tree: Any, *, max_shard_size: int | str = "5GB") -> None:
    """Writes a flat tree of ``ShardedArray``s and tensors as a Hugging Face safetensors folder (collective).

    The folder holds ``model.safetensors`` when every tensor fits in one file of
    ``max_shard_size`` bytes, else ``model-00001-of-0000n.safetensors`` files and
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``): what
    ``transformers``' ``save_pretrained`` writes, and what ``from_pretrained``,
    ``safetensors.torch.load_file`` and ``fshard.load`` read. Each tensor is whole in
    one file, with ``{"format": "pt"}`` metadata.

    Each file is created by one rank (different ranks create different files), and every
    rank writes the bytes of the boxes it holds straight into the files (each replicated
    box once, by one holder): nothing crosses ranks, and no rank holds more than its own
    shards. Every rank must see the folder (one machine or a shared file system, as for
    ``fshard.save``). Files are written under temporary names and
    appear when every file is complete: a new folder appears whole (one rename); in an
    existing folder (beside a ``config.json``, say) the weight files are replaced one by
    one, the index last, and weight files of an earlier save that the new one does not
    name are removed.

    Args:
        path: the folder (created if missing). Every rank must pass the same path.
        tree: a dict of names to ``ShardedArray``s and plain tensors (one value that
            every rank holds). Nested dicts are flattened with ``"."``:
            ``{"model": {"norm": x}}`` saves ``"model.norm"``.
        max_shard_size: bytes per file, an int or a str such as ``"5GB"`` (10**9 bytes)
            or ``"512MiB"`` (2**20). A tensor larger than this gets a file of its own.

    Raises:
        TypeError: ``tree`` is not a dict of str keys whose leaves are arrays or tensors, or it
            names a tensor twice or ``"__metadata__"`` (the key of the file's metadata).
        SpecError: a bad ``max_shard_size``, or an array with a pending reduction (``Partial``).
        CheckpointError: ``path`` is a file or an fshard checkpoint, another save holds it,
            writing failed (naming the file), or ranks gave different trees.

    >>> import tempfile, torch, fshard
    >>> from safetensors.torch import load_file
    >>> w = fshard.shard(torch.arange(12.0).reshape(4, 3), fshard.Chunk(0, [0, 1]))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fshard.save_safetensors(d + "/model", {"w": w, "b": torch.ones(3)})
    ...     back = load_file(d + "/model/model.safetensors")
    >>> sorted(back), back["w"].equal(fshard.gather(w))
    (['b', 'w'], True)
    """
    root, leaves, limit = Path(), list[tuple[str, Any]](), 0
    try:
        root = Path(os.path.abspath(checkpoint_path(path, "save_safetensors()")))
        _flatten(tree, "", leaves)
        _check_names(leaves)
        limit = parse_size(max_shard_size)
        backend, failure = _backend_of(leaves), None
    except (TypeError, SpecError, CheckpointError) as exc:  # reported through the first exchange, so no rank waits
        backend, failure = default_backend(), exc
    structure = {"dict": [[name, {"leaf": i}] for i, (name, _) in enumerate(leaves)]}
    options = f"max_shard_size={limit} bytes"  # every rank plans the same files
    summarise = lambda: prepare(root, structure, leaves, backend, failure, options)  # noqa: E731
    (_, summaries, _), seen = agree_on(backend, "fshard.save_safetensors", summarise, lambda out: out[0])
    check_same(backend, seen, summaries, leaves, what="fshard.save_safetensors")
    ranks = [f.rank for f in seen] if backend.spans_processes else _local_ranks(leaves)
    _write_all(root, leaves, limit, backend, ranks, seen[0].token)


def _flatten(tree: Any, prefix: str, out: list[tuple[str, Any]]) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"save_safetensors() tree must be a dict of names to arrays and tensors, got {type(tree).__name__}."
        )
    mapping: Mapping[Any, Any] = tree  # pyright: ignore[reportUnknownVariableType]
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise TypeError(f"save_safetensors() tree key {key!r} at {prefix or 'the root'} is not a str.")
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            _flatten(value, name, out)
        elif isinstance(value, torch.Tensor) and value.is_nested:
            raise TypeError(f"save_safetensors() tree holds a tensor at {name!r} that is a nested tensor; {NESTED}")
        elif isinstance(value, (ShardedArray, torch.Tensor)):
            out.append((name, value))
        else:
            msg = f"save_safetensors() tree holds a {type(value).__name__} at {name!r}: give ShardedArrays or tensors."
            raise TypeError(msg)


def _check_names(leaves: Sequence[tuple[str, Any]]) -> None:
    """Each name once, and none that the safetensors header keeps for its metadata."""
    seen: set[str] = set()
    for name, _ in leaves:
        if name == METADATA_KEY:
            msg = (
                f"save_safetensors() tree names a tensor {name!r}, the key a safetensors header keeps for its "
                "metadata (no reader would accept the file): rename the tensor."
            )
            raise TypeError(msg)
        if name in seen:
            raise TypeError(f"save_safetensors() tree names {name!r} twice (nested dicts join keys with '.').")
        seen.add(name)


def _backend_of(leaves: Sequence[tuple[str, Any]]) -> Backend:
    backends = {leaf.backend for _, leaf in leaves if isinstance(leaf, ShardedArray)}
    if len(backends) > 1:
        msg = f"The tree holds arrays on different backends {sorted(b.name for b in backends)}; save them separately."
        raise SpecError(msg)
    return backends.pop() if backends else default_backend()


def _local_ranks(leaves: Sequence[tuple[str, Any]]) -> list[int]:
    ranks = sorted({r for _, leaf in leaves if isinstance(leaf, ShardedArray) for r in leaf.layout.ranks})
    return ranks or [0]


def _writers(sizes: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """A writer per file: largest files first, each to the rank with the fewest bytes so far."""
    load = dict.fromkeys(ranks, 0)
    out = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        out[k] = min(ranks, key=lambda r: (load[r], r))
        load[out[k]] += sizes[k]
    return out


def _write_all(
    root: Path, leaves: list[tuple[str, Any]], limit: int, backend: Backend, ranks: list[int], token: str
) -> None:
    values = [leaf for _, leaf in leaves]
    nbytes = [math.prod(v.shape) * v.dtype.itemsize for v in values]
    files = [[f[i] for i in write_order([leaves[i][0] for i in f], [values[i].dtype for i in f])]
             for f in shard_files(nbytes, limit)]  # fmt: skip
    names = file_names(len(files))
    writers = _writers([sum(nbytes[i] for i in f) for f in files], ranks)
    stage, leader = stage_for(root, token), backend.holds(ranks[0])
    with contextlib.ExitStack() as lock:
        fresh = [False]  # the folder did not exist when the save began: its commit is one rename

        def begin() -> None:
            if leader:
                if check_target(root):
                    lock.enter_context(save_lock(root))  # one save at a time into an existing folder
                else:
                    fresh[0] = True
                with writing(stage):
                    stage.mkdir()

        def create() -> None:
            create_files(files, names, writers, leaves, backend, stage)

        def write() -> None:
            write_boxes(files, names, writers, leaves, backend, stage)

        def finish() -> None:
            if leader:
                index = _index(leaves, files, names, nbytes) if len(files) > 1 else None
                commit(root, stage, names, index, fresh=fresh[0])

        try:
            agree(backend, "fshard.save_safetensors", begin)
            agree(backend, "fshard.save_safetensors", create)
            agree(backend, "fshard.save_safetensors", write)
            agree(backend, "fshard.save_safetensors (commit)", finish)
        except BaseException:
            if leader:
                discard(stage)
            raise


def _index(leaves: list[tuple[str, Any]], files: list[list[int]], names: list[str], nbytes: list[int]) -> str:
    weights = {leaves[i][0]: names[k] for k, f in enumerate(files) for i in f}
    index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": dict(sorted(weights.items()))}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"
