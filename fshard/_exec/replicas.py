"""Data that every rank must hold alike, compared by digest: global tensors and replicas.

Two promises of the SPMD model are about data, not calls, and no movement sees them
broken:

- a plain tensor passed where a global value is expected (``shard(t, spec)`` with
  ``src=None``, and so a tensor argument of ``shard_map``) is the same on every rank.
  Each rank's own rows passed there are taken as the whole batch on every rank;
- the copies of a replicated box hold equal data (``replica_ids``). Copies that were
  updated differently drift apart, and ``gather`` and ``save`` read one of them.

``check_global`` (check mode) and ``check_leaves`` (``check_replicas``; ``gather`` and
``save`` in check mode) compare digests (``fshard._base.digest``: bits, dtype and shape)
in one exchange per call, one small entry per tensor a rank holds; every rank reads the
same table and reaches the same verdict, so all raise or none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from fshard import _config
from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._base.calls import call_name
from fshard._base.digest import Kind, digest, kind_of
from fshard._errors import CollectiveMismatchError, ReplicaMismatchError
from fshard._layout.layout import Layout, replica_ids

__all__ = ["check_global", "check_leaves", "checking"]

_COLS = 4  # a row of the replica table: leaf, shard, and the 16-byte digest as two int64


def checking() -> bool:
    """Whether check mode is on (``config(check_collectives=True)`` or ``FSHARD_CHECK=1``)."""
    return _config.current().check_collectives


def check_global(
    backend: Any,
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    gradient: bool = False,
    tree: tuple[str, str] | None = None,
) -> None:
    """In check mode, raises on every rank unless every rank passed the same ``tensors``.

    ``tensors`` are (description, tensor) pairs. One exchange of a digest per tensor (a
    second only where ranks hold them on different device types, which hash differently);
    nothing outside check mode or in one process. ``gradient``: the tensors are the
    gradients of a value that every rank holds whole (a gathered tensor), which differ where
    ranks computed their losses from per-rank data. ``tree``: the tensors are the leaves of
    a pytree, ``(description, structure)``, whose structure every rank must pass alike too.

    Raises:
        CollectiveMismatchError: ranks passed other numbers of tensors, trees of other
            structures, or a tensor differs between ranks, naming it, the ranks grouped by
            digest, and ``fshard.from_local_tensor`` for per-rank batches.
    """
    if not (checking() and backend.spans_processes and getattr(backend, "member", True)):
        return
    kinds: list[Kind] = [kind_of(t) for _, t in tensors]
    mine = [(k, digest(t, k)) for k, (_, t) in zip(kinds, tensors)]
    if tree is not None:  # the structure's digest rides as one more entry
        mine.append(("bytes", hashlib.blake2b(tree[1].encode(), digest_size=16).digest()))
    seen = _entries(backend, backend.exchange(mine))
    _same_count(backend, seen, len(tensors), tree)
    if tree is not None:
        structures = _grouped(backend, [entry[-1][1] for entry in seen])
        if len(structures) > 1:
            msg = (
                f"{tree[0]} differs between ranks in its structure: {_groups(structures, 'passed')} (this rank's: "
                f"{tree[1]}). Every rank passes the same tree, of the same keys and nodes (SPMD); to shard one "
                "rank's tree, pass src=k."
            )
            raise CollectiveMismatchError(msg)
        seen = [entry[:-1] for entry in seen]
    if any(len({pair[0] for pair in column}) > 1 for column in zip(*seen)):  # a tensor's kinds differ
        mine = [("device", digest(t, "device")) for _, t in tensors]
        seen = _entries(backend, backend.exchange(mine))
    for n, (what, _) in enumerate(tensors):
        groups = _grouped(backend, [entry[n][1] for entry in seen])
        if len(groups) > 1:
            message = _gradient_message if gradient else _global_message
            raise CollectiveMismatchError(message(what, groups, len(seen)))


def _grouped(backend: Any, values: Sequence[bytes]) -> list[tuple[bytes, list[int]]]:
    """The ranks of ``backend`` grouped by their value (in ``values``, in rank order)."""
    groups: dict[bytes, list[int]] = {}
    for rank, value in zip(backend.ranks, values):
        groups.setdefault(value, []).append(rank)
    return list(groups.items())


def _same_count(backend: Any, seen: Sequence[Any], n: int, tree: tuple[str, str] | None) -> None:
    """Raises where the ranks passed other numbers of tensors (``seen``: each rank's entries)."""
    extra = 0 if tree is None else 1
    counts: dict[int, list[int]] = {}
    for rank, entry in zip(backend.ranks, seen):
        counts.setdefault(len(entry) - extra, []).append(rank)
    if len(counts) > 1:
        call = call_name()
        what = tree[0] if tree is not None else f"The tensors passed{f' to {call}' if call is not None else ''}"
        passed = ", ".join(f"ranks {ranks} passed {k} tensor{'s' * (k != 1)}" for k, ranks in sorted(counts.items()))
        msg = (
            f"{what} differs between ranks: {passed} (this rank passed {n}). Every rank passes the same "
            "tensors (SPMD); to shard one rank's tree, pass src=k."
        )
        raise CollectiveMismatchError(msg)


def _entries(backend: Any, seen: list[Any]) -> list[Any]:
    """The peers' digest entries, checked to be lists of what ``check_global`` sends (they are untrusted)."""
    for rank, entry in zip(backend.ranks, seen):
        if not _is_entry(entry):
            raise CollectiveMismatchError(f"Refused digests from rank {rank}: not a list of (kind, bytes) pairs.")
    return seen


def _is_entry(entry: Any) -> bool:
    if type(entry) is not list:
        return False
    pairs = cast("list[Any]", entry)
    return all(type(e) is tuple and len(e) == 2 and e[0] in ("bytes", "device") and type(e[1]) is bytes for e in pairs)


def _global_message(what: str, groups: list[tuple[bytes, list[int]]], world: int) -> str:
    call = call_name()
    where = f" (in {call})" if call is not None else ""
    return (
        f"{what}{where} differs between ranks: {_groups(groups, 'passed')}. A plain tensor passed there is a "
        "global value that every rank holds whole (SPMD): each rank keeps its own boxes of it. Each rank's "
        "own rows (a DistributedSampler's batch) would be taken as the whole batch on every rank, so each "
        f"would train on 1/{world} of it. Make one array of the per-rank blocks instead: "
        "fshard.from_local_tensor(t, dim=0) stacks them in rank order (and shard_map takes that array as it "
        "is); or pass one rank's tensor with fshard.shard(t, spec, src=k)."
    )


def _gradient_message(what: str, groups: list[tuple[bytes, list[int]]], world: int) -> str:
    return (
        f"{what} differs between ranks: {_groups(groups, 'computed')}. Every rank holds that tensor whole "
        "and must compute the same loss from it (SPMD); each rank would keep its own boxes of a different "
        "gradient, so the shards would train on different losses. Per-rank data (a DistributedSampler's "
        "batch) taken as the batch does this: make one array of the per-rank blocks with "
        f"fshard.from_local_tensor(t, dim=0) and compute the loss of all {world} ranks' rows with shard_map "
        "and a Partial result."
    )


def _groups(groups: Sequence[tuple[bytes, Sequence[int]]], verb: str) -> str:
    ordered = sorted(groups, key=lambda g: min(g[1]))
    return ", ".join(f"ranks {sorted(set(ranks))} {verb} digest {d.hex()[:8]}" for d, ranks in ordered)


# -- replicas ---------------------------------------------------------------------------------


@cached(256)
def _watched(layout: Layout) -> tuple[np.ndarray, Kind]:
    """Which shards have a copy to compare with (non-empty boxes held twice or more), and the digest kind.

    The kind follows from the placements, alike on every rank: ``"bytes"`` when every
    shard is on the CPU, else ``"device"`` (CPU copies too, so that copies compare).
    Shards on the meta device hold no values and are left out.
    """
    ids, devices = replica_ids(layout), layout.columns.devices
    types = {d: torch.device(d).type for d in set(devices)}
    mask = np.zeros(ids.shape, bool)
    if ids.size:
        mask = (np.bincount(ids)[ids] > 1) & (layout.columns.sz > 0).all(axis=1)
    if "meta" in types.values():  # a shard on the meta device holds no values to compare
        mask &= np.array([types[d] != "meta" for d in devices])
    mask.flags.writeable = False
    return mask, "bytes" if set(types.values()) <= {"cpu", "meta"} else "device"


def check_leaves(leaves: Sequence[tuple[str, ShardedArray]], what: str) -> None:
    """Raises on every rank if the copies of some replicated box of ``leaves`` hold different data.

    ``leaves`` are (description, array) pairs, the same on every rank: ``"the
    ShardedArray at ['w']"``. One exchange per process group among them (none on the
    local backend, none where no layout has copies), of one row per copy this process holds.

    Raises:
        ReplicaMismatchError: naming the first leaf and box whose copies differ, the ranks
            grouped by digest, and the fix.
    """
    by_backend: dict[Any, list[int]] = {}
    for k, (_, a) in enumerate(leaves):
        if _watched(a.layout)[0].any():
            by_backend.setdefault(a.backend, []).append(k)
    for backend, ks in by_backend.items():
        if not getattr(backend, "member", True):
            continue
        rows = _rows(leaves, ks, backend)
        if backend.spans_processes:
            seen = backend.exchange(rows.tobytes())
            rows = np.concatenate([_decode(b, r, leaves, ks) for r, b in zip(backend.ranks, seen)])
        _verdict(rows, leaves, ks, what)


def _rows(leaves: Sequence[tuple[str, ShardedArray]], ks: Sequence[int], backend: Any) -> np.ndarray:
    """This process's rows: (leaf, shard, digest) for every copy it holds that has another copy."""
    rows: list[np.ndarray] = []
    for k in ks:
        a = leaves[k][1]
        mask, kind = _watched(a.layout)
        for i, t in zip(backend.addressable(a.layout), a.addressable_data):
            if mask[i]:
                rows.append(np.concatenate([[k, i], np.frombuffer(digest(t, kind), np.int64)]))
    return np.stack(rows) if rows else np.zeros((0, _COLS), np.int64)


def _decode(data: Any, rank: int, leaves: Sequence[tuple[str, ShardedArray]], ks: Sequence[int]) -> np.ndarray:
    """Rank ``rank``'s rows, checked: they index the leaves and shards compared (they are untrusted)."""
    if type(data) is not bytes or len(data) % (8 * _COLS):
        raise CollectiveMismatchError(f"Refused replica digests from rank {rank}: not rows of {_COLS} int64.")
    rows = np.frombuffer(data, np.int64).reshape(-1, _COLS)
    sizes = np.full(len(leaves), -1, np.int64)
    sizes[list(ks)] = [len(leaves[k][1].layout.columns.rank) for k in ks]
    leaf = rows[:, 0]
    inside = (leaf >= 0) & (leaf < len(leaves))
    if not (inside.all() and (rows[:, 1] >= 0).all() and (rows[:, 1] < sizes[leaf]).all()):
        raise CollectiveMismatchError(f"Refused replica digests from rank {rank}: a row names no shard compared.")
    return rows


def _verdict(rows: np.ndarray, leaves: Sequence[tuple[str, ShardedArray]], ks: Sequence[int], what: str) -> None:
    """Raises for the first leaf (in tree order) with a box whose copies' digests differ."""
    bad: list[tuple[int, np.ndarray]] = []
    for k in ks:
        mine = rows[rows[:, 0] == k]
        ids = replica_ids(leaves[k][1].layout)[mine[:, 1]]
        distinct = np.unique(np.column_stack([ids, mine[:, 2:]]), axis=0)
        split, counts = np.unique(distinct[:, 0], return_counts=True)
        differing = split[counts > 1]
        if differing.size:
            bad.append((k, differing))
    if bad:
        raise ReplicaMismatchError(_replica_message(rows, leaves, bad, what))


def _replica_message(
    rows: np.ndarray, leaves: Sequence[tuple[str, ShardedArray]], bad: list[tuple[int, np.ndarray]], what: str
) -> str:
    k, differing = bad[0]
    name, layout = leaves[k][0], leaves[k][1].layout
    mine = rows[rows[:, 0] == k]
    copies = mine[replica_ids(layout)[mine[:, 1]] == differing[0]]
    groups: dict[bytes, list[int]] = {}
    for shard, d in zip(copies[:, 1].tolist(), copies[:, 2:]):
        groups.setdefault(d.tobytes(), []).append(int(layout.columns.rank[shard]))
    box = layout._shard(int(copies[0, 1]))  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
    boxes = sum(int(d.size) for _, d in bad)
    more = "" if boxes == 1 else f" In all, {boxes} boxes of {len(bad)} arrays differ: {_names(leaves, bad)}."
    return (
        f"{what}: the copies of {name} hold different data. Box [offsets {box.offsets}, sizes {box.sizes}] "
        f"has {len(groups)} values among its {len(copies)} copies: {_groups(list(groups.items()), 'hold')}.{more} "
        "The copies of a replicated box must stay equal, or reads see one copy and lose the others. They drift "
        "apart when ranks update them differently, most often by training each rank on its own rows (a "
        "DistributedSampler's batch) as if they were the whole batch: make one array of the per-rank batches "
        "with fshard.from_local_tensor(t, dim=0), so that every rank computes the same gradient, and never "
        "write into one copy alone (from_local_shards_and_layout takes the copies as given)."
    )


def _names(leaves: Sequence[tuple[str, ShardedArray]], bad: list[tuple[int, np.ndarray]]) -> str:
    names = [leaves[k][0] for k, _ in bad[:4]]
    return ", ".join(names) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
