"""``map_local`` of arrays that share a layout: each result's layout inferred from its shards.

The result keeps the arguments' layout, with dims that no shard splits resized to the
function's new extent.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import optree
import torch

from fshard._api.map_context import per_shard, refuse_closed, refuse_closed_apart, used_gathered
from fshard._api.move import check_tensor, resolved
from fshard._array.array import ShardedArray
from fshard._base.compile import opaque, unwrapped
from fshard._errors import SpecError
from fshard._exec import gathered as _varying
from fshard._exec.agree import (
    agree,
    describe_results,
    holds_nothing_somewhere,
    link_without_blocks,
    merge_gradients,
    merge_results,
    untouched,
    with_gradient,
)
from fshard._exec.draws import RankDraws
from fshard._layout.layout import Layout, ShardMeta, with_partial, with_terms

__all__ = ["is_plain", "map_same"]


def map_same(fn: Callable[..., Any], arrays: Sequence[ShardedArray], pending: str | None) -> Any:
    """``map_local`` of arrays that share a layout (``pending``: the result is a pending sum).

    Each result leaf's layout is inferred from its shards: the arguments' layout, with
    dims that no shard splits resized to the new extent. Where some process holds no
    shard, the processes share what ``fn`` returned (structure, dtypes, shapes), so
    that one learns them too, and an error ``fn`` raised anywhere is raised everywhere.
    """
    first = arrays[0]
    backend, base = first.backend, with_partial(first.layout, None)
    index = backend.addressable(first.layout)
    terms = next((a.layout.terms for a in arrays if a.layout.partial is not None), None)

    usage = _varying.Usage()
    own = [t for a in arrays for t in a.addressable_data]
    # In one process, the closed-over tensors each rank's calls used, counted per rank, where a rank that used
    # none would not join their sums in the backward across processes (below); and refused where no view of them
    # can sum their gradient (a custom Function's input), as processes refuse them.
    # A C function (an operator's: ``operator.add``, ``torch.eq``) closes over nothing but the object it is bound to.
    counted = not (backend.spans_processes or torch.compiler.is_compiling() or _closes_over_nothing(fn))
    counted = counted and torch.is_grad_enabled()
    closed_by_rank: dict[int, set[int]] | None = {} if counted else None

    def compute() -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
        blocks = zip(*(a.addressable_data for a in arrays))
        # In one process each rank's calls draw random numbers from a stream of their own, as each process does.
        draws = None if backend.spans_processes else RankDraws()
        ranks: list[int] = first.layout.columns.rank[list(index)].tolist() if draws is not None else []
        try:
            with untouched(own, "map_local()"):
                if closed_by_rank is None:
                    with per_shard(backend, usage, first.layout, own):
                        outs = tuple(_drawn(draws, ranks, k, fn, *ts) for k, ts in enumerate(blocks))
                else:  # each rank's calls in a context of their own, which notes the closed-over tensors they use
                    outs = tuple(
                        _drawn(draws, ranks, k, called, ts, closed_by_rank.setdefault(r, set()))
                        for k, (r, ts) in enumerate(zip(ranks, blocks))
                    )
        finally:
            if draws is not None:
                draws.end()
        return _result_leaves(outs)

    def called(blocks: Sequence[torch.Tensor], seen: set[int]) -> Any:
        with per_shard(backend, usage, first.layout, own, seen):
            return fn(*blocks)

    def results(
        tree: Any, leaves: list[tuple[torch.Tensor, ...]], metas: Sequence[Any], used: set[int], grads: Sequence[bool]
    ) -> Any:
        if tree is None:  # no shard anywhere: the result's link joins every argument's
            link = link_without_blocks(arrays, first.dtype, used)
            return ShardedArray(_pending(base, pending, terms), (), backend, first.dtype, link)
        out: list[ShardedArray] = []
        for n, (dtype, sizes) in enumerate(metas):
            layout = _pending(_infer_layout(base, sizes), pending, terms)
            if leaves:
                out.append(ShardedArray(layout, leaves[n], backend, dtype))
                continue
            out.append(ShardedArray(layout, (), backend, dtype, link_without_blocks(arrays, dtype, used, grads[n])))
        return optree.tree_unflatten(tree, out)

    if holds_nothing_somewhere(backend, first.layout):

        def describe(r: tuple[Any, list[tuple[torch.Tensor, ...]]]) -> Any:
            grads = tuple(with_gradient(leaf) for leaf in r[1])
            return (
                describe_results(r[0], [dict(zip(index, leaf)) for leaf in r[1]]),
                (usage.ages(), usage.closed),
                grads,
            )

        (tree, leaves), seen = agree(backend, compute, describe)
        tree, metas = merge_results([d for d, _, _ in seen], "map_local()")
        used = used_gathered(backend, first.layout, [u for _, u, _ in seen], "map_local()")
        return results(tree, leaves, metas, used, merge_gradients([g for _, _, g in seen], len(metas)))
    # Every process holds blocks: none waits for the others, and none learns what the others' fn returned.
    # A structure or dtype that differs per process is caught by the next movement's headers where the
    # results' layouts or dtypes differ (design notes).
    tree, leaves = compute()
    metas = (describe_results(tree, [dict(zip(index, leaf)) for leaf in leaves]) or (None, []))[1]
    if closed_by_rank is not None and any(a.requires_grad for a in arrays):
        # What processes learn in the backward (a closed-over tensor's sum that some ranks do not join).
        refuse_closed_apart(backend, first.layout, {r: len(ids) for r, ids in closed_by_rank.items()}, "map_local()")
    else:  # where no argument records, the result's link tells ranks apart at its next movement, here as there
        most = usage.closed if closed_by_rank is None else max(map(len, closed_by_rank.values()), default=0)
        refuse_closed(backend, first.layout, most, "map_local()")  # one rank's count, as each process counts
    return results(tree, leaves, metas, set(), ())  # every rank holds blocks: no link


def _drawn(draws: RankDraws | None, ranks: Sequence[int], k: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, the ``k``-th call, after ``draws`` has put back its rank's random state (where it counts)."""
    if draws is not None:
        draws.before(ranks[k])
    return fn(*args)


def _closes_over_nothing(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a function of C (``operator.add``, ``torch.eq``) not bound to a tensor (``w.mul``)."""
    fn = unwrapped(fn)  # map_local's fn as the caller passed it
    return isinstance(fn, types.BuiltinFunctionType) and not isinstance(getattr(fn, "__self__", None), torch.Tensor)


def _pending(layout: Layout, pending: str | None, terms: Any) -> Layout:
    """``layout`` with the pending op of a linear map of pending sums, and their summands' terms."""
    return layout if pending is None else with_terms(with_partial(layout, pending), terms)


_LEAF = optree.tree_structure(cast(Any, 0))  # the structure of a single leaf


def _result_leaves(outs: Sequence[Any]) -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
    """The results' tree structure (``None`` when there is none here) and each leaf's shards."""
    if not outs:
        return None, []
    if all(type(o) is torch.Tensor and is_plain(o) for o in outs):  # the common case: one plain tensor each
        leaves = [tuple(outs)]
        tree = _LEAF
    else:
        flat = [optree.tree_flatten(o) for o in outs]
        tree = flat[0][1]
        if any(spec != tree for _, spec in flat):
            raise SpecError(f"map_local() fn returned different structures on different shards: {tree} and others.")
        leaves = [
            tuple(resolved(check_tensor(f[0][n], "map_local() fn result")) for f in flat)
            for n in range(tree.num_leaves)
        ]
    for leaf in leaves:
        if len(leaf) > 1 and len({t.dtype for t in leaf}) > 1:
            raise SpecError(
                f"map_local() fn returned dtypes {sorted({str(t.dtype) for t in leaf})} on different shards."
            )
    return tree, leaves


def is_plain(t: torch.Tensor) -> bool:
    """Strided, not nested, quantized, conjugated or negated: kept as it is, unchecked."""
    return t.layout == torch.strided and not (t.is_nested or t.is_quantized or t.is_conj() or t.is_neg())


@opaque  # layout arithmetic in numpy: run eagerly under torch.compile
def _infer_layout(layout: Layout, sizes: dict[int, tuple[int, ...]]) -> Layout:
    """The layout of ``map_local``'s result, from the shapes of the result shards known here."""
    if all(s == tuple(layout.columns.sz[i].tolist()) for i, s in sizes.items()):
        return layout
    other = next((s for s in sizes.values() if len(s) != layout.ndim), None)
    if other is not None:
        msg = (
            f"map_local() fn returned a result of {len(other)} dims (a block of shape {list(other)}) from blocks of "
            f"{layout.ndim}; pass out_spec= for that result (a spec, or a Layout)."
        )
        raise SpecError(msg)
    shape = tuple(_new_extent(layout, sizes, d) for d in range(layout.ndim))
    return Layout(shape, tuple(_resize(s, layout.shape, shape) for s in layout.shards))


def _new_extent(layout: Layout, sizes: dict[int, tuple[int, ...]], d: int) -> int:
    """The result's extent along ``d``: the sum of the new sizes of the distinct intervals that tile the dim.

    There is one interval when no shard splits the dim.
    """
    new: dict[tuple[int, int], set[int]] = {}
    for i, s in sizes.items():
        m = layout._shard(i)  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
        new.setdefault((m.offsets[d], m.sizes[d]), set()).add(s[d])
    if all(k[1] == n for k, v in new.items() for n in v):
        return layout.shape[d]
    split = any(m.sizes[d] != layout.shape[d] for m in layout.shards)
    olds = sorted(k for k in new if k[1] > 0)
    if split:
        msg = (
            f"map_local() fn changed dim {d}, which the layout splits, from sizes {[k[1] for k in olds]} "
            f"to {[sorted(new[k]) for k in olds]}; pass out_spec= for the result."
        )
        raise SpecError(msg)
    covered = sum(k[1] for k in olds)
    tiles = all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(olds)) and olds and olds[0][0] == 0
    if any(len(new[k]) > 1 for k in olds) or not tiles or covered != layout.shape[d]:
        msg = (
            f"map_local() cannot infer the new extent of dim {d} from the shards held here "
            f"(new sizes per interval: { {k: sorted(v) for k, v in new.items()} }); pass out_spec=Layout(...)."
        )
        raise SpecError(msg)
    return sum(next(iter(new[k])) for k in olds)


def _resize(meta: ShardMeta, old: Sequence[int], new: Sequence[int]) -> ShardMeta:
    """``meta`` with every dim it spans whole stretched (or shrunk) to the new extent."""
    sizes = tuple(n if o == 0 and s == m else s for n, m, o, s in zip(new, old, meta.offsets, meta.sizes))
    return ShardMeta(meta.offsets, sizes, meta.placement)
