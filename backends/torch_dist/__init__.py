"""The torch.distributed backend: plans executed over Gloo (CPU tensors) or NCCL (CUDA tensors).

Every rank of the group calls each operation with the same arguments (SPMD). A rank
runs its own share of the plan, ``plan.for_rank(rank)``, which the core computes from
the two layouts alone (O(peers), never the global plan's O(world^2) rows):

- its local moves are slice copies between its own shards;
- what it sends and receives is deduplicated (a box goes once to a rank, even when that
  rank holds it twice) and exchanged: ``execute`` packs all boxes for one peer into
  one contiguous buffer and runs a single ``all_to_all_single`` with split sizes (no
  padding); ``scatter`` and ``assemble`` post one ``isend``/``irecv`` per box, straight
  from and into the tensors where a box is a contiguous range of them (boxes under
  256 KiB packed, one message per peer). ``execute`` does the same when every
  received box is a contiguous range of its shard and the boxes are few and large
  (chunk -> replicated, dim 0 -> dim 1 of big arrays), and ``launch`` where every
  received box is such a range and a rank sends 1 MiB or more on average
  (``_choice.by_messages``): the large boxes are not staged, so a movement in flight
  holds its outputs and the small boxes' packed messages only. A reduce phase of that
  size sends a large contribution straight from the summand and, over Gloo, receives
  one peer's messages at a time (``_reduce_messages``).

Which transport runs must be the same on every rank (``all_to_all_single`` needs the
whole group), so it is decided from the layouts, alike everywhere, not from one rank's
share: whether anything crosses ranks from ``min_elements_sent`` (closed form; plans are
minimal), whether received boxes land in place and how large the smallest box is from
each layout's distinct extents (``_choice.all_contiguous``, ``_choice.direct``).
Reductions (a plan with ``op`` or ``steps``) run phase by phase from the rank's share
too (``_reduce.reduce_schedule``), and decide whether anything crosses from each
phase's ``min_elements_sent``, the lower bound that every reduce phase meets.

The local copies run while the messages are in flight. Boxes that already lie back to
back in one tensor are sent (or received) in place rather than packed; outputs and
staging buffers come from memory that is already mapped (``fshard._base.alloc.new``), so
they do not pay a page fault per 4 KiB on every call. A rank's share of a plan (its
peers, split sizes, the slices of every box, which boxes need no packing, its shards
and transport: ``_choice.step``) is computed once per (layouts, rank, group), so a
repeated call does no index arithmetic.

Every movement that crosses ranks opens with a 24-byte header from each rank to every
rank (dtype, digests of the operation and both layouts, and of which leaves of a tree moved
as one record a gradient: ``_guard``); ranks that disagree
raise ``CollectiveMismatchError`` on every rank before reading data. Under Gloo a small
movement's data travels behind the headers in the same round; ``config(timeout=...)``
bounds every wait.

Placements name global ranks; a sub-group maps them to group ranks. The wire device
follows the group: CUDA for an NCCL group, CPU otherwise.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from fshard._base.cache import cached, clear_caches
from fshard._base.calls import call_name, moving_tree, recording_leaves, records_gradient
from fshard._config import current
from fshard._errors import SpecError
from fshard._layout.layout import Layout
from fshard._layout.show import describe_layout
from fshard._log import log_move
from fshard._plan.direct import Plan

from .._execution import Counters, new_shard, shard_device, slice_shards
from ._check import agreed, broke_in_flight, check, in_flight
from ._choice import all_contiguous, by_messages, direct, rows_in_order, step
from ._exchange import bounded_wait, gather_objects, outside_transforms
from ._group import check_layout, facts, weakly
from ._guard import Guard, guard
from ._later import Verdict
from ._later import drop as drop_checks
from ._later import pending as pending_checks
from ._later import post as post_check
from ._later import settle as settle_checks
from ._reduce_collective import collective_kind, combine_inline, run_collective, start_all_reduce
from ._reduce_messages import reduce_messages, run_by_messages
from ._reduce_phase import as_bytes, reduce_schedule, run_local, run_reduce
from ._subgroups import all_reduce_among, forget_subgroups
from ._transport import alltoall, copy_local, empty
from ._watch import handed

__all__ = ["TorchDistBackend"]

# At most this many checks left in flight (``check_later``): a longer run of calls that post one, with no
# collective between them, ends them at the next post.
_CHECKS_IN_FLIGHT = 64

_COUNTERS: dict[int, Counters] = {}
_NONE_ID = id(None)
_CPU = torch.device("cpu")
_WARM: set[int] = set()
# all_gather_single replaces the deprecated all_gather_into_tensor where torch has it
all_gather = cast(
    "Callable[..., dist.Work]",
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,  # pyright: ignore[reportUnknownMemberType, reportDeprecated]  # untyped in torch; for older torch
)
# The wire device types on which a gather of equal rows in group order goes by ``all_gather``:
# NCCL's fastest gather. Gloo's is slower than one message per box (2.8x at 256 MiB, 1.3-1.7x at
# 64 KiB-4 MiB on 4 processes: ``python -m fshard bench --only gather-all``).
ALL_GATHER_WIRES = frozenset({"cuda"})


_PROXY = torch._C._TorchDispatchModeKey.PROXY  # pyright: ignore[reportPrivateUsage]  # make_fx's tracing mode


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class TorchDistBackend:
    """Runs plans across the processes of a ``torch.distributed`` process group.

    Args:
        group: a process group from ``dist.new_group`` (``None``: the default group).

    Two backends are equal when they name the same group of the same default group
    (``world``, the default group when the backend was made): after
    ``destroy_process_group`` and a new ``init_process_group``, a new backend differs from
    the old ones, so nothing cached for them serves it. The backend refers to both groups
    weakly: an array does not keep a destroyed group alive, and refuses to move once torch
    has let go of its group. ``counters`` (shared by all backends of a group) count the
    elements this process sent and the collectives it ran.

    >>> import torch, fshard
    >>> from fshard.backends.torch_dist import TorchDistBackend
    >>> backend = TorchDistBackend()  # torch.distributed is initialised (e.g. by torchrun)
    >>> x = fshard.shard(torch.arange(6.0), fshard.Chunk(0, backend.ranks), backend=backend)
    >>> fshard.gather(fshard.reshard(x, fshard.Chunk(0, backend.ranks[::-1]))).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    >>> backend == fshard.backends.default_backend()
    True

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """

    name: str = dataclasses.field(default="torch_dist", init=False)
    # The groups, weakly: an array the program still holds (a module-level one, say) must not keep a
    # destroyed group alive until the interpreter's teardown, where its Gloo threads abort the process
    # ("terminate called without an active exception") as they let go of a finished collective's tensors.
    _group: Callable[[], Any] = dataclasses.field(repr=False)
    _group_id: int = dataclasses.field(repr=False)
    _world: Callable[[], Any] = dataclasses.field(repr=False)
    _world_id: int = dataclasses.field(repr=False)

    def __init__(self, group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            msg = (
                "TorchDistBackend needs torch.distributed to be initialised: call "
                "dist.init_process_group(...) first (torchrun does it for you), or use the local backend."
            )
            raise RuntimeError(msg)
        world = dist.GroupMember.WORLD
        if group is world:
            group = None
        object.__setattr__(self, "name", "torch_dist")
        object.__setattr__(self, "_group", weakly(group))
        object.__setattr__(self, "_group_id", id(group))
        object.__setattr__(self, "_world", weakly(world))
        object.__setattr__(self, "_world_id", id(world))

    @property
    def group(self) -> Any:
        """The process group (``None``: the default group).

        Raises:
            SpecError: torch has let go of the group (``destroy_process_group``), so its arrays
                cannot move any more.
        """
        group = self._group()
        if group is None and self._destroyed():
            msg = (
                "This array's process group was destroyed (dist.destroy_process_group), so the array cannot "
                "move any more: make it again on a live group (fshard.from_local_tensor, fshard.shard)."
            )
            raise SpecError(msg)
        return group

    def _destroyed(self) -> bool:
        """Whether torch has let go of this backend's group (given explicitly: the default group is ``None``)."""
        return self._group_id != _NONE_ID and self._group() is None

    @property
    def world(self) -> Any:
        """The default group this backend was made in; ``None`` once torch has let go of it (destroyed)."""
        return self._world()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TorchDistBackend)
            and self._group_id == other._group_id
            and self._world_id == other._world_id
            and self._group() is other._group()
            and self._world() is other._world()
        )

    def __hash__(self) -> int:
        return hash(("torch_dist", self._group_id, self._world_id))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (and copied) as its group alone: remade, it is that group's backend in the default group then."""
        return (TorchDistBackend, (self.group,))

    def __repr__(self) -> str:
        if self._destroyed():
            return "TorchDistBackend(destroyed group)"
        return f"TorchDistBackend(ranks={list(self.ranks)})" if self.member else "TorchDistBackend(non-member)"

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return facts(self.group).rank

    @property
    def ranks(self) -> tuple[int, ...]:
        """The group's global ranks, in group-rank order (empty when this process is not in it)."""
        return facts(self.group).ranks

    @property
    def spans_processes(self) -> bool:
        """``True``: each process of the group holds its own rank's data."""
        return True

    def holds(self, rank: int) -> bool:
        """Whether this process holds the data of global rank ``rank`` (it is this process's rank)."""
        return rank == self.rank

    @property
    def member(self) -> bool:
        """Whether this process belongs to the group."""
        return self.group is not dist.GroupMember.NON_GROUP_MEMBER

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return len(self.ranks)

    @property
    def counters(self) -> Counters:
        """Elements (and their bytes) this process sent to other ranks, and collectives it ran, on this group."""
        counters = _COUNTERS.get(self._group_id)
        if counters is None:
            counters = _COUNTERS[self._group_id] = Counters()
        return counters

    def addressable(self, layout: Any) -> tuple[int, ...]:
        """Indices of the shards placed on this process's rank."""
        return layout.indices_on(self.rank)

    def check_layout(self, layout: Any) -> None:
        """Raises ``SpecError`` if a shard sits on a rank outside the group or on a missing device."""
        check_layout(layout, facts(self.group), self.member)

    def execute(self, plan: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Runs ``plan``, phase by phase.

        A copy phase goes by one ``all_to_all_single`` of packed per-peer buffers, or, when
        every received box lands in place and the boxes are few and large, one message per
        box; a reduce phase combines contributions (under NCCL by ``all_reduce``/
        ``reduce_scatter_tensor`` where the layouts are theirs). On Gloo every element is
        summed in the local backend's order (its owner's summand first, then ascending rank):
        an all-reduce small enough to follow the headers (a loss, say) is one round, every
        rank's summand to every other rank; a larger one is a reduce-scatter to the owners
        and their parts sent to every rank.
        """
        itemsize = like.element_size()
        log_move("torch_dist", plan, itemsize, facts(self.group).rank)
        if plan.src.partial is not None and self.member:
            wire = self._wire
            kind = collective_kind(plan, self.ranks, wire.type == "cuda")
            if kind == "all_reduce" and wire.type == "cpu" and facts(self.group).alltoall and _on_wire(plan, wire):
                op = "reshard:all_reduce"
                guarded = self._guard(op, plan, like.dtype)
                if guarded.inline:
                    self._check(op, (plan.src, plan.dst), like.dtype)
                    (j,) = self.addressable(plan.dst)
                    with in_flight():
                        out = combine_inline(plan, tensors[0], guarded, self.group)
                    self._count(plan.for_rank(self.rank).elements_sent, out.element_size())
                    return (out.view(plan.dst._shard(j).sizes).to(shard_device(plan.dst, j)),)  # pyright: ignore[reportPrivateUsage]  # one shard's meta, not all
            if kind is not None and _on_wire(plan, wire) and _reduces(wire, like.dtype):
                return self._collective(kind, plan, tensors, like)
        for p in plan.phases:
            if p.op is None:
                out = self._move("reshard", p, tensors, None, like.dtype, direct=direct(p.src, p.dst, itemsize))
            else:  # a reduce phase, from this rank's share too (_reduce.reduce_schedule)
                out = {j: new_shard(p.dst, j, like) for j in self.addressable(p.dst)}
                self._reduce("reshard", p, tensors, out, like.dtype)
            tensors = tuple(out.values())
        return tuple(tensors)

    def launch(
        self,
        plan: Any,
        tensors: Sequence[torch.Tensor],
        like: torch.Tensor,
        *,
        series: str = "",
        checked: bool = False,
        given_up: bool = False,
    ) -> Callable[[], tuple[torch.Tensor, ...]]:
        """Starts ``plan`` and returns a function that waits for it and gives its result (``execute``'s).

        A pending sum into a full copy on every rank of the group (data parallel's
        gradients) runs as an ``all_reduce`` left in flight after the movement's round of
        headers, so computation goes on while it runs; on Gloo, one that is no bucket's (no
        ``series``: a prefetched pending sum) runs at once, in the local backend's order. A
        plan of one copy phase (a gather of a fully-sharded block's parameters) starts its
        messages after the movement's round of headers (where the data travels with the
        headers, they are checked at the wait) and leaves them in flight. Any other plan runs
        here, at once. A copy's sources must not change until the wait. ``given_up``:
        ``tensors`` are the caller's own buffers (a bucket's), which the sum may be written
        into; else they are left as they are.

        ``series`` names a sequence of launches (buckets) that every rank makes alike; it
        joins the round of headers, so ranks whose sequences differ raise at its first
        launch. ``checked``: the ranks agreed on the series before (its first launch, or a
        check that every rank posted at the call that made it): no round of headers here.
        """
        if not series and self._wire.type == "cpu" and self._all_reduces(plan, like.dtype):
            # A movement's all-reduce on Gloo (a prefetched pending sum) adds in the local backend's order, as
            # ``execute`` runs it: at once here, so the call that takes it gets the bits it would move itself.
            result = self.execute(plan, tensors, like)
            return lambda: result
        if self._all_reduces(plan, like.dtype):
            wire = self._wire
            op = _all_reduce_op(series)
            self._check(op, (plan.src, plan.dst), like.dtype)
            (j,) = self.addressable(plan.dst)
            mine = tensors[0].to(wire)
            sizes = plan.dst._shard(j).sizes  # pyright: ignore[reportPrivateUsage]  # one shard's meta, not all
            in_place = given_up and mine.is_contiguous() and tuple(mine.shape) == tuple(sizes)
            out = mine if in_place else empty(sizes, like.dtype, wire)  # a bucket is summed in place
            guarded = self._guard(op, plan, like.dtype)
            with in_flight():
                work = start_all_reduce(plan, mine, out, self.group, None if checked else guarded)

            def done() -> tuple[torch.Tensor, ...]:
                with in_flight():
                    guarded.wait(work)
                self._count(plan.for_rank(self.rank).elements_sent, out.element_size())
                return (out.to(shard_device(plan.dst, j)),)

            return done
        if plan.src.partial is None and self.member and len(plan.phases) == 1 and plan.phases[0].op is None:
            (p,) = plan.phases
            log_move("torch_dist", plan, like.element_size(), facts(self.group).rank)
            # Large, with every box landing in place: the large boxes are received into the outputs,
            # so in flight nothing but the outputs and the small boxes' packed messages is held.
            size = like.element_size()
            in_place = all_contiguous(p.src, p.dst) and by_messages(p, size, len(self.ranks))
            direct_ = in_place or direct(p.src, p.dst, size)
            # Named apart from a movement made at once: a rank that launches one (a prefetch) where the others
            # move other arrays of the same layouts at once raises with them, not receiving those arrays' data.
            out, finish = self._start_move(
                "reshard launched ahead", p, tensors, None, like.dtype, direct=direct_, own=True
            )

            def moved() -> tuple[torch.Tensor, ...]:
                finish()
                return tuple(out.values())

            return moved
        result = self.execute(plan, tensors, like)
        return lambda: result

    def scatter(
        self, full: torch.Tensor | None, layout: Any, src: int | None, plan: Plan | None
    ) -> tuple[torch.Tensor, ...]:
        """This rank's boxes of ``full``: sliced locally (``src=None``) or sent from rank ``src``.

        Only the boxes that other ranks need leave rank ``src``, each straight from
        ``full`` where it is a contiguous range of it; off ``src``, ``full`` is a
        stand-in that gives the dtype.
        """
        if full is None:
            raise SpecError(
                f"scatter(src={src}) needs a tensor on every rank (off src, an empty stand-in of the dtype)."
            )
        if src is None or plan is None:
            return self._slice(full, layout)
        self._require_member(f"shard(src={src})")
        self.check_rank(src, "src")
        mine = (full,) if self.rank == src else ()
        return tuple(self._move(f"shard(src={src})", plan, mine, None, full.dtype, direct=True).values())

    def receivers(self, layout: Layout, dst: int | None) -> tuple[int, ...]:
        """The ranks a gather delivers to: ``dst``, or every rank of the group."""
        self._require_member(f"gather(dst={dst})")
        return self.ranks if dst is None else (self.check_rank(dst, "dst"),)

    def assemble(
        self, layout: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor, dst: int | None, plan: Plan
    ) -> torch.Tensor | None:
        """The global tensor on every rank of the group (``dst=None``) or on rank ``dst`` only.

        Under NCCL, equal dim-0 chunks, one per rank in group order, gathered to every rank go
        by one ``all_gather_into_tensor``. Otherwise boxes that are contiguous ranges of the
        result (dim-0 chunks) are received straight into it; other boxes are staged once in
        one receive buffer.
        """
        op = f"gather(dst={dst})"
        self._require_member(op)
        p, target = plan, plan.dst
        receivers = target.ranks
        wire = self._wire.type
        if dst is None and len(receivers) > 1 and wire in ALL_GATHER_WIRES and rows_in_order(layout, receivers, wire):
            self._check(op, (p.src, p.dst), like.dtype)
            on = self._warm()  # the group's device: a shard on another GPU is copied there
            out = empty(layout.shape, like.dtype, on)
            g = self._guard(op, p, like.dtype)
            with in_flight():
                g.agree(self.group)
                got, mine = handed(as_bytes(out), as_bytes(tensors[0].to(on).contiguous()))
                g.wait(all_gather(got, mine, group=self.group, async_op=True))
            self._count(p.for_rank(self.rank).elements_sent, out.element_size())
            return out.to(self._out_device(layout, like))
        whole: dict[int, torch.Tensor] = {}
        if self.rank in receivers:
            whole[target.indices_on(self.rank)[0]] = empty(layout.shape, like.dtype, self._out_device(layout, like))
        self._move(f"gather(dst={dst})", p, tensors, whole, like.dtype, direct=all_contiguous(layout, target))
        return next(iter(whole.values()), None)

    def check_later(
        self, what: str, failed: bool, digest: int | tuple[int, ...], verdict: Verdict, *, defer: bool = False
    ) -> None:
        """Posts this rank's ``(failed, digest)`` for the check ``what``, ended by the group's next collective.

        ``digest``: a number within ±2**63, or a tuple of them of one length on every rank.
        ``defer``: the check waits on this rank for the next check posted, or the next
        collective, and goes with it, in one gather (a rank where it failed posts it at once).

        No rank waits for the others here. That collective hands every rank's pair, in group
        order, to ``verdict`` first, and raises the error it gives on every rank (``_later``).
        Under NCCL the check ends here, at once: its messages go through the GPU, and reading
        them later would make the CPU wait for all the GPU work queued meanwhile. In check
        mode the call's own end ends it (``settle``).
        """
        self._require_member(what)
        if current().check_collectives:  # check mode's round (and the checks before this one end)
            self._check(what, ())
            defer = False
        elif pending_checks(self.group) >= _CHECKS_IN_FLIGHT:  # a long run of calls without a collective
            self._settle_checks()
        # Else the checks posted before stay in flight with this one: ending them here would make every rank
        # wait for the slowest at each call that posts one (a shard_map of a stage, say), not at a collective.
        on_cuda = facts(self.group).on_cuda
        with in_flight():
            gathers = post_check(
                self.group, self.ranks, self._wire, what, failed, digest, verdict, defer=defer and not on_cuda
            )
        self.counters.collectives += gathers
        if on_cuda:
            self._settle_checks()

    def end_checks(self) -> None:
        """Ends the checks posted here and still in flight, raising the error they give (as the next collective would).

        For a call that refuses its input here, where the input may come from a call whose
        check says why (another rank's results differ): that check's error goes first, on every rank.
        """
        self._settle_checks()

    def _settle_checks(self) -> None:
        """The checks posted here end (``_later.settle``); those that waited to go with the next go now."""
        settle_checks(self.group, self._count_checks)

    def _count_checks(self, gathers: int) -> None:
        self.counters.collectives += gathers

    def exchange(self, obj: Any) -> list[Any]:
        """Every group rank's ``obj``, in group-rank order (``ranks[i]`` sent entry ``i``)."""
        self._require_member("an exchange of metadata (from_local_tensor, from_local_shards, equal, ...)")
        with outside_transforms():
            self._check("exchange", ())
            out = gather_objects(obj, self.group, self.world_size, self._wire, self.ranks)
        self.counters.collectives += 1
        return out

    def alike(self, digest: int | None) -> bool:
        """Whether every group rank passed this ``digest`` (``None``: one that matches none).

        One ``all_reduce`` of three numbers, whatever the group's size: where it says so, the
        ranks need not ``exchange`` what the digests stand for. ``digest`` must lie within
        ±2**62; every rank learns the same answer.
        """
        self._require_member("an exchange of metadata (from_local_tensor, from_local_shards, equal, ...)")
        mine = 0 if digest is None else digest
        if not -(1 << 62) < mine < 1 << 62:
            raise ValueError(f"fshard internal error: digest {mine} is not within ±2**62.")
        with outside_transforms():
            self._check("exchange", ())
            marks = torch.tensor([int(digest is None), mine, -mine], dtype=torch.int64, device=self._wire)
            with in_flight():
                (sent,) = handed(marks)
                work = cast(
                    "dist.Work",
                    dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=self.group, async_op=True),  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
                )
                bounded_wait(work, "a comparison of digests", self.group)
        self.counters.collectives += 1
        odd, high, low = cast("list[int]", marks.tolist())  # pyright: ignore[reportUnknownMemberType]  # torch's stub
        return not odd and high == -low

    # -- internals ---------------------------------------------------------------------

    def _collective(
        self, kind: str, p: Plan, tensors: Sequence[torch.Tensor], like: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        self._check(f"reshard:{kind}", (p.src, p.dst), like.dtype)
        (j,) = self.addressable(p.dst)
        out = empty(p.dst._shard(j).sizes, like.dtype, self._wire)  # pyright: ignore[reportPrivateUsage]  # one shard's meta, not all
        guarded = self._guard(f"reshard:{kind}", p, like.dtype)
        with in_flight():
            run_collective(kind, p, tensors[0].to(self._wire), out, self.group, guarded)
        self._count(p.for_rank(self.rank).elements_sent, out.element_size())
        return (out.to(shard_device(p.dst, j)),)

    def _reduce(
        self, op: str, p: Plan, tensors: Sequence[torch.Tensor], out: dict[int, torch.Tensor], dtype: torch.dtype
    ) -> None:
        self._require_member(op)
        self._check(op, (p.src, p.dst), dtype)
        src = dict(zip(self.addressable(p.src), tensors))
        sched = reduce_schedule(p, self.rank, self.ranks)  # from p.for_rank(rank): no global rows
        if p.min_elements_sent == 0:  # the phase's bound, which it meets, alike on every rank: no collective
            run_local(sched, src, out, dtype)
            return
        guarded = self._guard(op, p, dtype)
        wire = self._warm()
        with in_flight():
            if by_messages(p, dtype.itemsize, len(self.ranks)) and not guarded.inline:
                plan = reduce_messages(p, self.rank, self.ranks, dtype.itemsize)
                run_by_messages(sched, plan, src, out, dtype, wire, self.group, empty, guarded)
            else:
                run_reduce(sched, src, out, dtype, wire, self.group, empty, guarded)
        self._count(sched.sent, dtype.itemsize)

    def _warm(self) -> torch.device:
        """The wire device, with the NCCL communicator created (before the first P2P message)."""
        wire = self._wire
        if wire.type == "cuda" and id(self.group) not in _WARM:
            (zero,) = handed(torch.zeros(1, device=wire))
            dist.all_reduce(zero, group=self.group)  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
            _WARM.add(id(self.group))
        return wire

    @property
    def _wire(self) -> torch.device:
        """The device messages go through: the current CUDA device for NCCL, else the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if facts(self.group).on_cuda else _CPU

    def _slice(self, full: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
        self._check("shard(src=None)", (layout,))
        return slice_shards(full, layout, self.addressable(layout))

    def _out_device(self, layout: Layout, like: torch.Tensor) -> torch.device:
        mine = self.addressable(layout)
        return shard_device(layout, mine[0]) if mine else (like.device if like.device == self._wire else self._wire)

    def all_reduce_among(
        self,
        t: torch.Tensor,
        ranks: tuple[int, ...],
        partition: tuple[tuple[int, ...], ...] = (),
        extra: tuple[float, ...] = (),
    ) -> torch.Tensor:
        """The sum of ``t`` over the processes of global ``ranks`` (``psum`` in a ``shard_map`` body).

        Every rank of the group calls it alike, each with the ranks it sums with (this rank
        among them), one group of ``partition`` (every group of the sum); one ``all_reduce``
        on the process group of those ranks. With ``extra`` numbers (of ``t``'s dtype), they
        are summed in the same all-reduce, after ``t``'s elements: the result is then flat.
        """
        self._require_member("psum")
        # In check mode every rank compares the partition too (the axes it sums over): the same on every rank.
        self._check("psum", (), t.dtype, f" within {sorted(map(sorted, partition))}" if partition else "")
        with in_flight():
            out = all_reduce_among(t, ranks, self._wire, partition or (ranks,), extra)
        n = len(ranks)
        size = t.numel() + len(extra)
        self._count(2 * (n - 1) * size // n, t.element_size())  # a ring all-reduce's elements from each rank
        return out

    def check_rank(self, rank: Any, what: str) -> int:
        """``rank`` as an int; raises ``SpecError`` unless it is a global rank of the group."""
        if isinstance(rank, (str, bool, np.bool_)) or rank not in self.ranks:
            msg = (
                f"{what}={rank!r}: Global rank {rank!r} does not exist in input process group "
                f"(global ranks {list(self.ranks)})."
            )
            raise SpecError(msg)
        return int(rank)

    def _require_member(self, op: str) -> None:
        if not self.member:
            msg = (
                f"{op}: rank {self.rank} is not in the process group (the group of the call's arrays, or its "
                "group= argument); call collective fshard functions on a group only from its ranks."
            )
            raise SpecError(msg)

    def _check(self, op: str, layouts: tuple[Layout, ...], dtype: torch.dtype | None = None, detail: str = "") -> None:
        """Before a collective: the checks left in flight end (``_later``); in check mode, one check round.

        The round: every rank is about to run this collective, or all raise. ``detail``: more
        that every rank must agree on (compared, not shown where a public call names the op).
        """
        if self.member:
            self._settle_checks()
        if self.member and current().check_collectives:
            moves = " -> ".join(describe_layout(x) for x in layouts)
            what = f"{op}({moves}){detail}" + (f" on {dtype}" if dtype is not None else "")
            call = call_name()  # the public call it serves, which describes the arguments already
            if call is not None:
                what = f"{call}, at {op} #{hashlib.blake2b(what.encode(), digest_size=4).hexdigest()}"
            elif torch._C._current_graph_task_id() != -1:  # pyright: ignore[reportPrivateUsage]  # autograd runs it, from no public call
                what = f"a backward pass's {what} (loss.backward() or torch.autograd.grad)"
            check(self.group, self.ranks, self.rank, what)

    def settle(self, what: str, error: BaseException | None = None) -> None:
        """In check mode, the check that ends a public call: how it ended here is ``what``.

        ``error`` is the error, which the caller raises once every rank has learned of it.
        An error that every rank raises already, or one out of a collective in flight (a
        peer gone: the others are not at the store), ends the call at once.
        """
        if not (self.member and current().check_collectives):
            return
        if error is not None and (agreed(error) or broke_in_flight(error)):
            return
        try:
            check(self.group, self.ranks, self.rank, what, error)
        except Exception:
            drop_checks(self.group)
            if error is None:
                raise
            return
        # The checks the call posted (what its function returned), on every rank once it ended: their verdicts
        # now where it returned everywhere; where it raised, every rank raises what the round compared.
        if error is None:
            self._settle_checks()
        else:
            drop_checks(self.group)

    def _move(
        self,
        op: str,
        p: Plan,
        tensors: Sequence[torch.Tensor],
        out: dict[int, torch.Tensor] | None,
        dtype: torch.dtype,
        *,
        direct: bool,
    ) -> dict[int, torch.Tensor]:
        """Runs the copy phase ``p`` into ``out`` (default: new destination shards); returns ``out``."""
        out, finish = self._start_move(op, p, tensors, out, dtype, direct=direct)
        finish()
        return out

    def _start_move(
        self,
        op: str,
        p: Plan,
        tensors: Sequence[torch.Tensor],
        out: dict[int, torch.Tensor] | None,
        dtype: torch.dtype,
        *,
        direct: bool,
        own: bool = False,
    ) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
        """Starts the copy phase ``p`` into ``out`` (default: new destination shards).

        Returns ``out`` and the function that waits for the messages: ``out`` holds the result
        once it has returned. The round of headers ends here (every rank moves alike, or all
        raise); a round that carries the data inline is checked at the wait. ``own``: the
        messages may stay in flight while other movements run (``launch``).
        """
        self._require_member(op)
        self._check(op, (p.src, p.dst), dtype)
        g = facts(self.group)
        s = step(p, g.rank, g.ranks, direct, g.alltoall, dtype.itemsize)  # from p.for_rank(rank): no global rows
        src = dict(zip(s.src, tensors))
        if not s.crosses:  # closed form, alike on every rank (plans are minimal): no collective
            out = s.outputs(dtype) if out is None else out
            copy_local(s.schedule, src, out)
            return out, _nothing
        wire, guarded = self._warm(), self._guard(op, p, dtype)
        with in_flight():
            opened = guarded.open(self.group)  # a round of headers alone, in flight while outputs are made
        # A launched movement whose messages are received into a buffer anyway (one all-to-all,
        # not in place) makes its outputs at its wait: they are not alive while it is in flight.
        ex = s.schedule.plain if guarded.inline else s.schedule.exchange
        packed = s.transport is alltoall or guarded.inline
        later = own and out is None and packed and ex.recv_span is None
        if out is None:
            out = {} if later else s.outputs(dtype)
        with in_flight():
            wait = s.transport(s.schedule, src, out, dtype, wire, self.group, guarded, opened, own=own, later=later)

        def finish() -> None:
            if later:  # before the wait's scope: an allocation that fails is this rank's own error
                out.update(s.outputs(dtype))
            with in_flight():
                wait()
            self._count(s.schedule.sent, dtype.itemsize)

        return out, finish

    def _all_reduces(self, plan: Any, dtype: torch.dtype) -> bool:
        """Whether ``launch`` runs ``plan`` as one ``all_reduce`` (a pending sum into a full copy on every rank)."""
        if plan.src.partial is None or not self.member:
            return False
        wire = self._wire
        kind = collective_kind(plan, self.ranks, wire.type == "cuda")
        return kind == "all_reduce" and _on_wire(plan, wire) and _reduces(wire, dtype)

    def _guard(self, op: str, p: Plan, dtype: torch.dtype) -> Guard:
        """The movement's header and round (``_guard``): ranks that move differently raise, every one.

        Raises:
            SpecError: under a trace that records the function to replay it (``torch.func.linearize``,
                ``make_fx``): a collective is not recorded, so the replay would give the values of the trace.
        """
        if torch._C._get_dispatch_mode(_PROXY) is not None:  # pyright: ignore[reportPrivateUsage]
            msg = (
                f"{op}: fshard's movements across processes cannot be traced to be replayed (torch.func.linearize, "
                "make_fx): the trace does not record the collective, so the replay would not move the data. Use "
                "torch.func.jvp (or jacfwd) instead of linearize."
            )
            raise SpecError(msg)
        g = facts(self.group)
        return guard(
            op,
            p.src,
            p.dst,
            dtype,
            g.ranks,
            g.rank,
            self._wire,
            g.alltoall,
            records_gradient(),
            recording_leaves(),
            moving_tree(),
        )

    def _count(self, sent: int, itemsize: int) -> None:
        """One collective that sent ``sent`` elements of ``itemsize`` bytes from this rank."""
        counters = self.counters
        counters.elements_sent += sent
        counters.bytes_sent += sent * itemsize
        counters.collectives += 1


# Gloo reduces none of these (RuntimeError "Invalid scalar type"): their pending sums go by messages,
# combined here with torch's ops, as the small ones always do.
_GLOO_UNREDUCED = frozenset(
    getattr(torch, name)
    for name in (
        "int16",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
)


def _reduces(wire: torch.device, dtype: torch.dtype) -> bool:
    """Whether the collective backend on ``wire`` reduces ``dtype`` (Gloo on the CPU lacks a few)."""
    return wire.type != "cpu" or dtype not in _GLOO_UNREDUCED


def _all_reduce_op(series: str) -> str:
    """The name an all-reduce's header carries: with the series it starts, where it starts one."""
    return f"reshard:all_reduce {series}" if series else "reshard:all_reduce"


def _nothing() -> None:
    """The wait of a movement that is done already."""


@cached(256)
def _on_wire(p: Plan, wire: torch.device) -> bool:
    """Whether every shard of both layouts is placed on the wire's device type (as every rank sees)."""
    return all(torch.device(d).type == wire.type for d in {*p.src.columns.devices, *p.dst.columns.devices})


@atexit.register
def _let_go_of_groups() -> None:
    """At exit, fshard's tables let go of the process groups they name, while other threads can still run.

    ``destroy_process_group`` drops torch's references, and a group is freed with the last one. A
    group that fshard still held (a cache keyed on it, the groups that ``psum`` made) would
    be freed at the interpreter's teardown instead, where a Gloo thread that lets go of a finished
    collective's tensors (the program's own last ``all_reduce``, say) aborts the process ("terminate
    called without an active exception"). The backends that arrays hold, and the table of the groups'
    facts, refer to their groups weakly, so a module-level array keeps none alive either. An exit
    handler registered before this one, and so run after it, that still calls fshard fills the tables
    again.
    """
    forget_subgroups()
    clear_caches()
