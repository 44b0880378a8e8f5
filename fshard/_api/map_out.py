"""Result layouts: which ``out_spec`` lays out each result, and the layout it gives the result's blocks.

The function runs once per slot (``map_slots``): the output layout's k-th shard on a
placement is the result of that placement's k-th call. Specs match results by place (a
dict's spec by its key, sequences by position). A result's layout is checked against the
shapes of its blocks and the placements where the function ran, and an ``out_spec`` that
claims copies of results whose arguments differ is refused (JAX's replication check).
Layouts are made once per spec and block shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import optree
import torch

from fshard._api import map_trees as _trees
from fshard._api.map_slots import Slot, arg_name, slot_index, slots_of
from fshard._api.psum import groups_of as _psum_groups
from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._exec.agree import tree_kinds
from fshard._layout.layout import Layout, replica_ids
from fshard._layout.placement import Placement
from fshard._layout.specs import Explicit, Mesh, Partial, Replicated, as_layout

__all__ = [
    "Alike",
    "alike_form",
    "alike_metas",
    "check_out_specs",
    "check_replicas",
    "known_here",
    "laid_out",
    "leaf_specs",
    "out_layout",
    "spec_structure",
]


_PROBE = 1 << 20  # an extent at which every part of a spec is non-empty


def spec_structure(out_specs: Any) -> Any:
    if _trees.is_spec(out_specs):
        return optree.tree_structure(cast(Any, 0))  # a single leaf
    return optree.tree_structure(out_specs, is_leaf=_trees.is_spec, none_is_leaf=True)


def known_here(spec: Any) -> bool:
    """Whether this rank's own blocks lay out a result of ``spec``: a ``Layout``, or a spec of full copies.

    Full copies: every placement holds the whole array (``Replicated``, ``Partial(Replicated)``).
    Where every rank holds blocks, such results need no exchange of outcomes: each rank's
    global shape is its block's, and ranks whose results differ in shape or dtype raise at
    the next movement of the array (its header names both layouts and the dtype).
    """
    if isinstance(spec, Partial):
        spec = spec.spec
    return isinstance(spec, (Layout, Replicated))


def leaf_specs(out_specs: Any, tree: Any, what: str) -> list[Any]:
    """One spec per result leaf: ``out_specs`` broadcast (a single spec) or matched to the results' tree."""
    if _trees.is_spec(out_specs):
        return [out_specs] * (tree.num_leaves if tree is not None else 1)
    flat, given = _flat_specs(out_specs, tree)
    if tree is not None and tree.num_leaves != len(flat):
        msg = f"{what} out_specs has {len(flat)} specs but fn returned {tree.num_leaves} tensors ({tree})."
        raise SpecError(msg)
    if tree is not None:
        order = _spec_order(given, tree, what)
        if order is not None:
            flat = [flat[k] for k in order]
    return flat


def _flat_specs(out_specs: Any, tree: Any) -> tuple[list[Any], Any]:
    """``out_specs``' specs and their structure.

    A ``None`` is a spec (a hole in a sequence of specs), except where the results hold
    ``None`` at its place: then it stands for that ``None`` (``{"y": spec, "aux": None}``).
    """
    flat, given = optree.tree_flatten(out_specs, is_leaf=_trees.is_spec, none_is_leaf=True)
    if tree is not None and tree.num_leaves != len(flat) and any(x is None for x in flat):
        fewer, structure = optree.tree_flatten(out_specs, is_leaf=lambda x: x is not None and _trees.is_spec(x))
        if len(fewer) == tree.num_leaves:
            return fewer, structure
    return flat, given


def check_out_specs(out_specs: Any, results: Any, what: str, maker: str) -> None:
    """Refuses ``out_specs`` that would lay out ``results`` by other results' specs (``_spec_order``)."""
    if not _trees.is_spec(out_specs):
        tree = optree.tree_structure(results)
        given = _flat_specs(out_specs, tree)[1]
        if given.num_leaves == tree.num_leaves:  # else a count that fshard.shard_map refuses as such
            _spec_order(given, tree, what, maker)


def _spec_order(given: Any, tree: Any, what: str, maker: str = "fn") -> tuple[int, ...] | None:
    """Which spec lays out each result (``_match_paths``), made once per pair of structures where they hash."""
    try:
        return _matched(given, tree, what, maker)
    except TypeError:  # a structure that cannot be hashed (a node's metadata): matched afresh
        return _match_paths(given, tree, what, maker)


def _match_paths(given: Any, tree: Any, what: str, maker: str) -> tuple[int, ...] | None:
    """Per result leaf, the position of the spec at its place; ``None`` where they are in the same order.

    Specs match results by place: a dict's spec by its key, whatever order each dict's leaves
    come in (a ``dict``'s sorted, an ``OrderedDict``'s as inserted). A spec inside a container
    of one spec at a result's place lays out that result (``(spec,)`` for one tensor). Sequences
    pair by position (a list of specs for a tuple of results; results with ``None`` between
    them). Specs at other places (other keys, a sequence of specs for a dict of results) would
    lay out a result by another's spec: ``SpecError``.
    """
    specs, results = given.paths(), tree.paths()
    if specs == results or len(results) == 1:
        return None
    try:
        where = {p: k for k, p in enumerate(specs)}
    except TypeError:  # a place that cannot be hashed: compared in order only
        where = {}
    if len(where) < len(specs):  # no places to look up (or two specs at one): none matched by place
        where = {}
    order = [where.get(p, -1) for p in results]
    taken = set(order)
    for n, r in enumerate(results):  # a container of one spec at the result's place
        if order[n] < 0:
            inside = [k for k, p in enumerate(specs) if k not in taken and p[: len(r)] == r]
            if len(inside) == 1:
                order[n] = inside[0]
                taken.add(inside[0])
    if -1 not in order:
        return None if order == list(range(len(order))) else tuple(order)
    if all(_by_position(p, r) for p, r in zip(specs, results)):  # sequences only: paired in order
        return None
    named = set(map(repr, results))  # by repr: a place need not hash
    lost = [r for r, k in zip(results, order) if k < 0] or results
    stray = [p for p in specs if repr(p) not in named] or specs
    msg = (
        f"{what} out_specs does not match {maker}'s results: its spec at {_path(stray[0])} would lay out the "
        f"result at {_path(lost[0])} ({tree}). Give out_specs the structure of {maker}'s results, with the "
        "same dict keys, or one spec for all of them."
    )
    raise SpecError(msg)


def _by_position(spec: tuple[Any, ...], result: tuple[Any, ...]) -> bool:
    """Whether two places differ only in sequence positions (a key never pairs by position)."""
    return len(spec) == len(result) and all(a == b or (type(a) is int and type(b) is int) for a, b in zip(spec, result))


_matched = cached(256)(_match_paths)


def _path(path: tuple[Any, ...]) -> str:
    return _trees.path_text(path) or "the top"


@dataclasses.dataclass(frozen=True)
class Alike:
    """A result's block shapes where every placement holds blocks of the same shapes: the k-th ``shapes[k]``."""

    shapes: tuple[tuple[int, ...], ...]

    def spread(self, layout: Layout) -> dict[Slot, tuple[int, ...]]:
        """The shape of the block at each slot of ``layout`` (the arguments' placements)."""
        return {slot: self.shapes[slot[1]] for slot in slot_index(layout).values()}


def alike_metas(
    found: Sequence[tuple[torch.dtype, dict[Slot, tuple[int, ...]]]],
) -> list[tuple[torch.dtype, Alike]] | None:
    """Per result leaf, its dtype and its block shapes by position on this rank's one placement.

    ``None`` where this rank's blocks lie on several placements, or skip a position.
    """
    out: list[tuple[torch.dtype, Alike]] = []
    for dtype, shapes in found:
        slots = list(shapes)
        if len({p for p, _ in slots}) != 1 or sorted(k for _, k in slots) != list(range(len(slots))):
            return None
        out.append((dtype, Alike(tuple(shapes[slot] for slot in sorted(slots, key=lambda slot: slot[1])))))
    return out


def alike_form(description: Any) -> Any:
    """What a rank's description (``run_per_slot``'s ``describe``) says, naming no rank; ``None`` where it cannot.

    Ranks whose forms are equal returned one structure and dtypes, blocks of the same shapes
    at each position of their one placement, and used the same gathered and closed-over
    tensors and buckets, and their results record a gradient alike: each can then rebuild the
    others' descriptions from its own.
    """
    results, (ages, closed), series, grads, form, summed = description
    if results is None:
        return None
    tree, found = results
    metas = alike_metas(found)
    if metas is None:
        return None
    leaves = [(str(dtype), alike.shapes) for dtype, alike in metas]
    return repr(tree), tree_kinds(tree), leaves, sorted(ages), closed, series, form, grads, summed


def out_layout(
    spec: Any, shapes: dict[Slot, tuple[int, ...]] | Alike, first: Layout, pending: str | None, what: str, n: int
) -> Layout:
    """The layout of result ``n``, checked against the block shapes and the slots of ``first`` (where ``fn`` ran).

    The block shapes are those known here: every rank's where they were exchanged (or
    alike). Made once per spec and shapes (``laid_out``): on thousands of ranks a layout
    and its checks take milliseconds.
    """
    key = shapes if isinstance(shapes, Alike) else tuple(shapes.items())
    try:
        hash(spec)
    except TypeError:  # a spec that cannot be hashed: laid out afresh
        return _lay_out(spec, key, first, pending, what, n)
    return laid_out(spec, key, first, pending, what, n)


def _lay_out(
    spec: Any,
    key: tuple[tuple[Slot, tuple[int, ...]], ...] | Alike,
    first: Layout,
    pending: str | None,
    what: str,
    n: int,
) -> Layout:
    shapes = key.spread(first) if isinstance(key, Alike) else dict(key)
    slots = set(slot_index(first).values())
    if spec is None:
        raise SpecError(f"{what} needs an out_spec for result {n}.")
    layout = spec if isinstance(spec, Layout) else as_layout(spec, _infer_shape(spec, shapes, what, n))
    placed = set(slot_index(layout).values())
    if placed != slots:
        extra, lost = sorted(placed - slots, key=str), sorted(slots - placed, key=str)
        where = [f"blocks on {_names(extra)}, where fn did not run"] if extra else []
        where += [f"no block on {_names(lost)}, where fn ran"] if lost else []
        msg = (
            f"{what} result {n}: out_spec {spec!r} gives {' and '.join(where)}; give it the arguments' "
            "placements, with as many blocks on each."
        )
        raise SpecError(msg)
    if pending is not None and layout.partial != pending:
        msg = (
            f"{what} ran linearly on pending sums, so result {n} is a pending sum: give out_spec as "
            f"fshard.Partial(...), got {spec!r}."
        )
        raise SpecError(msg)
    for i, (p, k) in slot_index(layout).items():
        got = shapes.get((p, k))
        if got is not None and got != layout._shard(i).sizes:  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
            msg = (
                f"{what} result {n} on placement {p} has shape {got} but out_spec gives that block "
                f"sizes {layout._shard(i).sizes} (global shape {layout.shape})."  # pyright: ignore[reportPrivateUsage]
            )
            raise SpecError(msg)
    return layout


laid_out = cached(256)(_lay_out)


# Where a call's bodies summed (``psum``): their mesh, their placements in body order, and each psum's axes.
Summed = tuple[Mesh, tuple[Placement, ...], tuple[tuple[str, ...], ...]]


def check_replicas(
    layouts: tuple[Layout, ...],
    names: Sequence[int | str],
    out: Layout,
    spec: Any,
    what: str,
    n: int,
    summed: Summed | None = None,
) -> None:
    """Refuses ``out`` where it makes copies of results whose arguments differ.

    ``summed``: where the bodies reduced with ``psum``, a result may also depend on the
    blocks of every placement summed with its own, so those are compared too.

    Raises:
        SpecError: naming the argument, the placements (and the mesh axes of a ``Named``
            out spec) along which the claimed copies get different blocks, and the fixes.
    """
    found = _replica_conflict(layouts, out, summed)
    if found is None:
        return
    k, p, q, grouped = found
    axes = _mesh_axes(spec, p, q)
    along = f" along mesh axis {axes[0]!r}" if len(axes) == 1 else f" along mesh axes {axes}" if axes else ""
    partial = f"fshard.Partial(spec, over={tuple(axes)!r})" if axes else "fshard.Partial(spec)"
    opt_out = (
        "pass check_vma=False if fn returns equal results there"
        if what.startswith("shard_map")
        else "run the module through fshard.shard_map(..., check_vma=False) if it returns equal results there"
        if what.startswith("apply_module")
        else "use fshard.shard_map(..., check_vma=False) if fn returns equal results there"
    )
    gives = (
        f"gives the placements that fn's psum over {' and over '.join(map(repr, summed[2]))} sums with them "
        "different blocks (or alike ones, added in another order)"
        if grouped and summed is not None
        else "gives those placements different blocks"
    )
    msg = (
        f"{what} out_spec {spec!r} makes the copies of result {n} on placements {p} and {q} replicas{along}, "
        f"but {arg_name(names[k])} {gives}, so the results there may differ "
        "and the array would hold replicas that disagree. Give an out_spec that splits the result"
        f"{along} (or {partial} if its copies are partial sums), reshard the result afterwards, "
        f"or {opt_out}."
    )
    raise SpecError(msg)


@cached(256)
def _replica_conflict(
    layouts: tuple[Layout, ...], out: Layout, summed: Summed | None = None
) -> tuple[int, Placement, Placement, bool] | None:
    """Two placements ``p``, ``q`` that ``out`` gives copies of one value but ``argument`` does not.

    ``(argument, p, q, grouped)``, or ``None`` if there are none; ``grouped`` where the argument's
    own blocks there are equal and those of their groups (below) are not. Placement by placement, the
    arguments' blocks (their replica ids) say what a result may depend on: slots with
    equal blocks of every argument give equal results. Where the bodies summed over mesh
    axes (``summed``), a result depends on the blocks of every placement of its group too,
    in the group's order: slots whose groups hold equal blocks, position by position, and
    whose own blocks are equal give equal results.
    """
    ids = replica_ids(out)
    keep = np.flatnonzero(np.all(out.columns.sz > 0, axis=1))  # an empty block holds nothing to disagree
    if len(np.unique(ids[keep])) == len(keep):
        return None  # no two non-empty blocks are copies: nothing is claimed
    out_slots = slot_index(out)
    kept = [out_slots[i] for i in keep.tolist()]
    # Per kept output shard, an id of what each argument gives its slot (its block, and its group's).
    blocks = np.stack([_ids_of(lay, kept, summed) for lay in layouts], axis=1).reshape(len(keep), len(layouts))
    _, first, group = np.unique(ids[keep], return_index=True, return_inverse=True)
    lead = first[group.reshape(-1)]
    bad = np.flatnonzero(np.any(blocks != blocks[lead], axis=1))
    if not len(bad):
        return None
    row = int(bad[0])
    k = int(np.flatnonzero(blocks[row] != blocks[lead[row]])[0])
    a, b = kept[int(lead[row])], kept[row]
    own = _ids_of(layouts[k], [a, b], None)
    grouped = bool(own[0] == own[1])
    return k, a[0], b[0], grouped


def _ids_of(lay: Layout, slots: Sequence[Slot], summed: Summed | None) -> np.ndarray:
    """Per slot, an id that two slots share where argument ``lay`` gives them blocks that give equal results.

    Its own block's replica id. Where the bodies summed (``summed``), a psum over axes A gives
    every placement of an A-group one sum of its members' values, added in the group's order
    (the placements'; two summands in either order); so two placements are alike where their
    own blocks are, and, for each A, the members of their A-groups are alike, position by
    position. Refined until nothing splits: each round costs one look at each placement per A.
    """
    rid, where = replica_ids(lay), slots_of(lay)

    def one(p: Placement, k: int) -> int:
        blocks = where.get(p, ())
        return int(rid[blocks[k]]) if k < len(blocks) else -1

    if summed is None:
        return np.array([one(p, k) for p, k in slots], dtype=np.int64)
    mesh, placements, sets = summed
    index = {p: i for i, p in enumerate(placements)}
    members = [_sum_groups(mesh, placements, axes) for axes in sets]
    out = np.zeros(len(slots), dtype=np.int64)
    for k in sorted({k for _, k in slots}):  # a block number at a time (a psum's body is one per placement)
        ids = np.unique(np.array([one(p, k) for p in placements], dtype=np.int64), return_inverse=True)[1]
        while True:
            columns = [ids.reshape(-1)]
            for groups, of in members:
                rows = ids[groups]
                if rows.shape[1] == 2:  # a + b and b + a are the same bits
                    rows = np.sort(rows, axis=1)
                columns.append(np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1)[of])
            refined = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)[1].reshape(-1)
            if refined.max(initial=-1) == ids.max(initial=-1):  # no class split: a fixed point
                break
            ids = refined
        at = [i for i, (_, kk) in enumerate(slots) if kk == k]
        out[at] = ids[[index[slots[i][0]] for i in at]]
    return out


@cached(256)
def _sum_groups(mesh: Mesh, placements: tuple[Placement, ...], axes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The groups of a psum over ``axes``, a (groups, members) array of body indices in the order it adds them.

    And each body index's group. (The groups of one psum are all of one size: the mesh's extent along ``axes``.)
    """
    groups, of = _psum_groups(mesh, placements, axes)
    return np.array(groups, dtype=np.int64).reshape(len(groups), -1), np.asarray(of, dtype=np.int64)


def _mesh_axes(spec: Any, p: Placement, q: Placement) -> list[str]:
    """The axes of a ``Named`` spec's mesh along which placements ``p`` and ``q`` lie apart (else none)."""
    inner = spec.spec if isinstance(spec, Partial) else spec
    mesh = getattr(inner, "mesh", None)
    if mesh is None or p not in mesh.ranks or q not in mesh.ranks:
        return []
    at = np.unravel_index([mesh.ranks.index(p), mesh.ranks.index(q)], mesh.shape)
    return [name for name, c in zip(mesh.axis_names, at) if c[0] != c[1]]


def _names(slots: list[Slot]) -> str:
    return "[" + ", ".join(f"{p}#{k}" if k else str(p) for p, k in slots) + "]" if slots else "no placement"


def _infer_shape(spec: Any, shapes: dict[Slot, tuple[int, ...]], what: str, n: int) -> tuple[int, ...]:
    """The global shape at which ``spec`` gives every slot the shape of its block."""
    inner = spec.spec if isinstance(spec, Partial) else spec
    if isinstance(inner, Layout):
        return inner.shape
    ndims = {len(s) for s in shapes.values()}
    if len(ndims) > 1:
        raise SpecError(f"{what} result {n} has blocks with different numbers of dims: {sorted(ndims)}.")
    ndim = ndims.pop() if ndims else 0
    if isinstance(inner, Explicit):
        return tuple(max((m.offsets[d] + m.sizes[d] for m in inner.shards), default=0) for d in range(ndim))
    probe = as_layout(inner, (_PROBE,) * ndim)
    slots = slot_index(probe)
    shape: list[int] = []
    for d in range(ndim):
        seen: dict[int, int] = {}
        for i, m in enumerate(probe.shards):
            if m.sizes[d] and m.offsets[d] not in seen and slots[i] in shapes:
                seen[m.offsets[d]] = shapes[slots[i]][d]
        shape.append(sum(seen.values()))
    return tuple(shape)
