"""Running a per-block function slot by slot, and wrapping its results as arrays.

Gradients follow one rule on every backend: a replicated value's gradient is the sum
of its uses. Where aligned arrays differ in how they replicate, a replicated argument's
copies feed computations that differ per copy, so the gradients of its copies are
summed (and every copy gets the total), and a replicated result's copies share its
gradient (each counts 1/copies), which together give the exact gradient by linearity.

Across processes, each process posts what its function returned (or that it raised),
and the group's next collective compares them; where some rank holds no block, or a
result's shape must be learned, the processes exchange their outcomes at the call.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import optree
import torch

from fshard._api import psum as _psum
from fshard._api.map_context import per_shard, refuse_closed, refuse_closed_apart, used_gathered
from fshard._api.map_out import (
    Alike,
    Summed,
    alike_form,
    alike_metas,
    check_replicas,
    known_here,
    leaf_specs,
    out_layout,
    spec_structure,
)
from fshard._api.map_slots import Slot, check_aligned, positions, slot_index, slots_of
from fshard._api.move import check_plain, resolved
from fshard._array.array import ShardedArray
from fshard._errors import SpecError
from fshard._exec import autograd as _autograd
from fshard._exec import body as _body
from fshard._exec import buckets as _buckets
from fshard._exec import fused as _fused
from fshard._exec import gathered as _varying
from fshard._exec.agree import (
    agree_alike,
    describe_results,
    form_apart,
    holds_nothing_somewhere,
    link_without_blocks,
    merge_gradients,
    merge_results,
    post_failure,
    post_outcome,
    recording_compared,
    refuse_recording,
    refuse_recording_apart,
    untouched,
    with_gradient,
)
from fshard._exec.draws import RankDraws
from fshard._exec.replicas import check_leaves, checking
from fshard._layout.layout import Layout

__all__ = ["Reducing", "regrouped", "run_per_slot"]


def run_per_slot(
    fn: Callable[..., Any],
    arrays: Sequence[ShardedArray],
    names: Sequence[int | str],
    out_specs: Any,
    pending: str | None,
    *,
    one_block: bool,
    what: str,
    check: bool = True,
    grouped: bool = False,
    reducing: Reducing | None = None,
    regathered: bool = False,
    form: tuple[str, str] = ("", ""),
) -> Any:
    """``fn`` on each placement's blocks of ``arrays``, and its results as arrays of ``out_specs``.

    ``form``: what the ranks must agree on besides the results (``agree.post_outcome``), as
    (what it is, this rank's text of it); every rank raises where the texts differ.
    """
    names = list(names) or list(range(len(arrays)))  # positions, or the caller's labels
    check_aligned(arrays, names, one_block, what)
    backend = arrays[0].backend
    first = arrays[0].layout
    # A replicated argument's copies may feed computations that differ per copy: sum their gradients
    # (``grouped``: the caller has).
    inputs = list(arrays) if grouped else _fused.regroup_tree(arrays, "sum")
    held = backend.addressable(first)
    slot_of = slot_index(first)

    usage = _varying.Usage()
    own = [t for a in inputs for t in a.addressable_data]
    # In one process, the closed-over tensors each rank's bodies used, counted per rank (as each process counts).
    closed_by_rank: dict[int, set[int]] | None = None if backend.spans_processes else {}
    rank_of: dict[Slot, int] = {}
    summed: set[tuple[str, ...]] = set()  # the mesh axes of each psum of the bodies

    def context(slot: Slot | None) -> Any:
        if slot is None or closed_by_rank is None:
            return per_shard(backend, usage, first, own)
        return per_shard(backend, usage, first, own, closed_by_rank.setdefault(rank_of[slot], set()))

    def compute() -> tuple[list[dict[Slot, torch.Tensor]], Any]:
        calls: list[tuple[Slot, list[torch.Tensor]]] = []
        if one_block and len(held) == 1:  # one placement here: each argument, aligned, has its one block here
            calls.append((slot_of[held[0]], [a._data[0] for a in inputs]))  # pyright: ignore[reportPrivateUsage]
        else:
            by_index = [dict(zip(backend.addressable(a.layout), a.addressable_data)) for a in inputs]
            for i in held:
                p, k = slot_of[i]
                calls.append(((p, k), [data[slots_of(a.layout)[p][k]] for a, data in zip(inputs, by_index)]))
        if closed_by_rank is not None:
            rank_of.update(zip((slot_of[i] for i in held), first.columns.rank[list(held)].tolist()))
        try:
            with untouched(own, what):
                results = _bodies(fn, calls, context, reducing, first, backend, rank_of, summed)
        finally:  # a tap's bucket belongs to this call: a block that outlives it (returned as it is) keeps none
            _varying.forget_taps(own)
        if len(series) > 1 or usage.closed or regathered:  # the backward runs other collectives between the taps
            _buckets.launch_at_end(series)
        return _flatten_results(results, what)

    # Every process must learn the blocks' shapes (to infer a global shape) or dtypes (where
    # it holds none): they share what fn returned, or the error it raised.
    inferred = not all(known_here(s) for s in leaf_specs(out_specs, None, what))
    # Buckets of the arguments' gradients (across processes only): the ranks compare them below.
    series = _buckets.series_of(own) if backend.spans_processes else []
    leaves: list[dict[Slot, torch.Tensor]]
    if backend.spans_processes and (inferred or holds_nothing_somewhere(backend, first)):

        def describe(r: tuple[list[dict[Slot, torch.Tensor]], Any]) -> Any:
            grads = tuple(with_gradient(leaf.values()) for leaf in r[0])
            series_of = tuple(s.series for s in series)
            described = describe_results(r[1], r[0]), (usage.ages(), usage.closed), series_of, grads, form[1]
            return (*described, tuple(sorted(summed)))

        (leaves, spec_tree), seen, described = agree_alike(backend, compute, describe, alike_form)
        if seen is None:  # every rank's results alike, placement for placement: nothing exchanged
            (_, found), (ages, closed), mine, _, _, _ = described
            grads: list[bool] | None = None  # every rank holds blocks: no link
            metas = cast("list[tuple[torch.dtype, Alike]]", alike_metas(found))
            refuse_closed(backend, first, closed, what)
            used = set(ages)
            _buckets.compare_series(series, [mine], backend.ranks, what)
        else:
            texts = [d[4] for d in seen]
            if any(t != form[1] for t in texts):
                apart = [r for r, t in zip(backend.ranks, texts) if t != texts[0]]
                raise form_apart(what, form, f"ranks {apart} and rank {backend.ranks[0]}")
            merged, metas = merge_results([d for d, *_ in seen], what)
            spec_tree = merged if merged is not None else spec_tree
            used = used_gathered(backend, first, [d[1] for d in seen], what)
            _buckets.compare_series(series, [d[2] for d in seen], backend.ranks, what)
            if recording_compared() and not holds_nothing_somewhere(backend, first):  # as the check posted below
                refuse_recording(what, {r: list(d[3]) for r, d in zip(backend.ranks, seen)})
            # A rank that holds no block: its links need a gradient where some rank's fn returned one with it.
            grads = merge_gradients([d[3] for d in seen], len(metas))
            summed.update(a for d in seen for a in d[5])  # every rank checks the copies alike
    else:
        # No process waits for the others here: each posts what fn returned (or that it raised), and the
        # group's next collective compares them, so a process whose fn returned otherwise raises with the others.
        try:
            leaves, spec_tree = compute()
            metas = (describe_results(spec_tree, leaves) or (None, []))[1]
            if closed_by_rank is None or (reducing is not None and reducing.threaded):  # not counted per rank
                refuse_closed(backend, first, usage.closed, what)
            else:
                refuse_closed_apart(backend, first, {r: len(ids) for r, ids in closed_by_rank.items()}, what)
            if not backend.spans_processes:  # as processes find it in the outcomes they post (below)
                refuse_recording_apart(backend, first, leaves, what)
            over = _summed_over(summed, reducing, first)
            out = _results(out_specs, spec_tree, leaves, metas, set(), inputs, arrays, names, held, pending, check,
                           what, None, over)  # fmt: skip
        except BaseException as exc:  # an interrupt too: the others' next collective learns of it
            if backend.spans_processes:
                post_failure(backend, what, exc)
            raise
        # Left for the backward's first collective, where every rank meets anyway (not a wait for the slowest
        # forward here); the buckets' series rides in it, so their first launch has no round of headers.
        # Whether each result records a gradient goes in too: a rank whose results record none would raise at
        # its backward alone while the others wait in theirs.
        if backend.spans_processes:
            recording = tuple(with_gradient(leaf.values()) for leaf in leaves) if recording_compared() else ()
            post_outcome(backend, what, (spec_tree, metas), _buckets.agreed(series), usage.closed, form, recording)
        return out
    over = _summed_over(summed, reducing, first)
    return _results(
        out_specs, spec_tree, leaves, metas, used, inputs, arrays, names, held, pending, check, what, grads, over
    )


def _summed_over(summed: set[tuple[str, ...]], reducing: Reducing | None, first: Layout) -> Summed | None:
    """The body's mesh, placements and the axes of each of its reductions (``None`` where none reduced)."""
    if not summed or reducing is None:
        return None
    placements = tuple(positions(first))
    return _psum.body_mesh(reducing.specs, placements), placements, tuple(sorted(summed))


def _results(
    out_specs: Any,
    spec_tree: Any,
    leaves: list[dict[Slot, torch.Tensor]],
    metas: Sequence[tuple[torch.dtype, dict[Any, tuple[int, ...]] | Alike]],
    used: set[int],
    inputs: Sequence[ShardedArray],
    arrays: Sequence[ShardedArray],
    names: Sequence[int | str],
    held: Sequence[int],
    pending: str | None,
    check: bool,
    what: str,
    grads: Sequence[bool] | None = None,
    summed: Summed | None = None,
) -> Any:
    """The result tree of ``run_per_slot``: each leaf's blocks in the layout its spec and their shapes give.

    ``grads``: per result, whether some rank's fn returned it with a gradient (``None``: not known here); a
    link of a result that none did needs none either. ``summed``: where the bodies' reductions summed
    (``_summed_over``), whose placements' blocks a result's copies are then compared over too.
    """
    first = arrays[0].layout
    backend = arrays[0].backend
    specs = leaf_specs(out_specs, spec_tree, what)
    if spec_tree is None:  # no slot anywhere: the structure comes from the specs
        spec_tree = spec_structure(out_specs)
    if not leaves:
        leaves = [{} for _ in specs]
    outs: list[ShardedArray] = []
    for n, (spec, blocks) in enumerate(zip(specs, leaves)):
        dtype, shapes = metas[n] if n < len(metas) else (arrays[0].dtype, {})
        if len(blocks) > 1 and len(kinds := {t.dtype for t in blocks.values()}) > 1:  # as merge_results says it
            raise SpecError(f"{what} result {n} has dtypes {sorted(map(str, kinds))} on different ranks; return one.")
        grad = grads is None or n >= len(grads) or grads[n]
        link = None if held else link_without_blocks(inputs, dtype, used, grad)
        layout = out_layout(spec, shapes, first, pending, what, n)
        if check:
            check_replicas(tuple(a.layout for a in arrays), names, layout, spec, what, n, summed)
        outs.append(_wrap(layout, backend, blocks, link, dtype))
    if not check and checking():  # replicas that fn was trusted to make equal: compare their contents
        check_leaves([(f"result {n} of {what}", a) for n, a in enumerate(outs)], what)
    return optree.tree_unflatten(spec_tree, outs)


class Reducing:
    """What the bodies of one ``shard_map`` need to reduce inside (``psum``): its in_specs.

    ``threaded`` is set once a body of it has reduced on the local backend, where its bodies
    then run in threads from the start; so is it for a new ``shard_map`` whose ``key`` has
    reduced before: by default its function's code (a body that a caller wraps anew at every
    step), or what a caller that builds the function gives (``apply_module``: its body's code,
    rules and method, so that its data-parallel calls do not run in threads for its
    tensor-parallel ones).
    """

    __slots__ = ("key", "specs", "threaded")

    def __init__(self, specs: Sequence[Any], fn: Callable[..., Any], key: Hashable = None) -> None:
        self.specs = tuple(specs)
        self.key = key if key is not None else getattr(inspect.unwrap(fn), "__code__", None)
        self.threaded = self.key is not None and self.key in _REDUCED

    def reduced(self) -> None:
        """Its bodies reduce: from now on they start in threads, and so do those of its key."""
        self.threaded = True
        if self.key is not None:
            _REDUCED.add(self.key)


_REDUCED: set[Hashable] = set()  # the keys of bodies that reduced (one entry per function written)


def _bodies(
    fn: Callable[..., Any],
    calls: Sequence[tuple[Slot, list[torch.Tensor]]],
    context: Callable[[Slot | None], Any],
    reducing: Reducing | None,
    layout: Layout,
    backend: Any,
    rank_of: Mapping[Slot, int],
    summed: set[tuple[str, ...]],
) -> list[tuple[Slot, Any]]:
    """``fn`` on each slot's blocks: one after another, or in threads where a body reduces in one process.

    Each call runs in ``context(slot)`` where one process runs every rank's, one after another
    (its rank's closed-over tensors counted apart); across processes, or in threads, in
    ``context(None)``. In one process each rank's bodies draw random numbers from a state of
    their own (``RankDraws``, by ``rank_of``, or by placement where they take turns in threads).
    ``summed`` gets the mesh axes of each reduction of the bodies.
    """
    apart = not backend.spans_processes
    if reducing is None:
        if apart:
            out: list[tuple[Slot, Any]] = []
            draws = RankDraws()
            try:
                for slot, blocks in calls:
                    draws.before(rank_of[slot])
                    with context(slot):
                        out.append((slot, fn(*blocks)))
            finally:
                draws.end()
            return out
        with context(None):
            return [(slot, fn(*blocks)) for slot, blocks in calls]
    position = positions(layout)
    placements = tuple(position)
    mesh = _psum.body_mesh(reducing.specs, placements)
    # One after another first; a body that reduces needs them all at once (in one process), which a torch.func
    # transform cannot run: there only a body that does reduce in this call is refused. Under saved-tensor hooks
    # (a checkpoint) no body runs ahead to find out: the hooks would see tensors that its recomputation does not
    # make, so the bodies take turns in threads from the start, in the order one after another would run them.
    ahead = not reducing.threaded and not _body.under_hooks()
    draws = RankDraws() if apart else None
    try:
        if backend.spans_processes or ahead or _body.in_transform():
            try:
                out = []
                with context(None) if not apart else contextlib.nullcontext():
                    for slot, blocks in calls:
                        here = context(slot) if apart else contextlib.nullcontext()
                        if draws is not None:
                            draws.before(rank_of[slot])
                        with (
                            here,
                            _body.entered(_body.Body(placements, position[slot[0]], mesh, backend, summed=summed)),
                        ):
                            out.append((slot, fn(*blocks)))
            except _body.NeedsThreads:
                reducing.reduced()
                if draws is not None:  # the threads draw from where the call found the generators
                    draws.restart()
            else:
                return out
        if _body.in_transform():
            msg = "psum() cannot run under a torch.func transform (grad, vmap, jvp); use loss.backward() instead."
            raise SpecError(msg)
        meeting = _body.Rendezvous(placements)

        def run(slot: Slot, blocks: list[torch.Tensor]) -> Callable[[], tuple[Slot, Any]]:
            def body() -> tuple[Slot, Any]:
                # A thread of its own: autograd numbers its nodes apart, so which tensors are closed over is not told.
                with (
                    context(None),
                    _body.entered(_body.Body(placements, position[slot[0]], mesh, backend, meeting, summed=summed)),
                ):
                    return slot, fn(*blocks)

            return body

        # One body runs at a time (turns), each from its rank's own random state, as across processes.
        def on_turn(index: int) -> None:
            if draws is not None:
                draws.before(placements[index].rank)

        return _body.run_threaded([run(slot, blocks) for slot, blocks in calls], meeting, on_turn)
    finally:
        if draws is not None:
            draws.end()


def _flatten_results(results: list[tuple[Slot, Any]], what: str) -> tuple[list[dict[Slot, torch.Tensor]], Any]:
    """Per result leaf, its block at each slot held here; and the results' tree structure."""
    tree = None
    leaves: list[dict[Slot, torch.Tensor]] = []
    for slot, out in results:
        flat, spec = optree.tree_flatten(out)
        if tree is None:
            tree = spec
            leaves = [{} for _ in flat]
        elif spec != tree:
            raise SpecError(f"{what} fn returned {spec} on placement {slot[0]} but {tree} elsewhere.")
        for n, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                raise SpecError(f"{what} fn must return tensors (or a pytree of them), got a {type(t).__name__}.")
            check_plain(t, f"{what} fn result")
            leaves[n][slot] = resolved(t)
    if tree is None:  # no slot here: the structure comes from the specs
        return [], None
    return leaves, tree


def _wrap(
    layout: Layout, backend: Any, blocks: dict[Slot, torch.Tensor], link: torch.Tensor | None, dtype: torch.dtype
) -> ShardedArray:
    slots = slot_index(layout)
    data = tuple(blocks[slots[i]] for i in backend.addressable(layout))
    if not data:
        return ShardedArray(layout, (), backend, dtype, link)
    out = ShardedArray(layout, data, backend)
    # A replicated result's copies were computed once each: together they count once.
    return regrouped(out, "share")


def regrouped(a: ShardedArray, mode: str) -> ShardedArray:
    """``a`` itself, or with gradients of its copies summed or shared (when it has copies and needs grad)."""
    # A pending sum's replicas of a summand (Layout.terms) share a result's gradient; its summands never sum theirs.
    copies = max(_autograd._copy_counts(a.layout), default=1)  # pyright: ignore[reportPrivateUsage]
    if (mode == "sum" and a.layout.partial is not None) or not a.requires_grad or copies < 2:
        return a
    data, link = _autograd.regroup(a.layout, a.backend, mode, a.addressable_data, a._first())  # pyright: ignore[reportPrivateUsage]  # package-internal
    return ShardedArray(a.layout, data, a.backend, a.dtype, link)
