"""Every movement's fingerprint, carried in its own messages, and waits with a bound.

Ranks that call one movement with different arguments (SPMD misuse: one rank's dtype,
spec or ``dst`` differs) would otherwise exchange bytes that each side reads by its own
plan: wrong values on every rank, or Gloo aborting a process that receives a message
longer than the receive it posted. So every movement that crosses ranks opens with a
round in which each rank sends every rank of the group a 24-byte header: a tag, the
dtype, digests of the operation (with the tree's, for one of a tree's several movements)
and of both layouts, and for a tree's leaves moved as one a digest of which of them record
a gradient (``Guard``, made once per cached movement).
Every rank receives every header, so every rank reaches the same verdict before it reads
any data: all equal, or ``CollectiveMismatchError`` naming which ranks sent what.

On Gloo that round is the data exchange itself for small movements: when the plan's
closed-form bytes (``min_elements_sent``) fit ``inline_bytes(world)``, each segment of the
``all_to_all_single`` is a header followed by that peer's data. Every rank posts a receive
of ``HEADER + inline_bytes`` from every peer, and no rank sends more (Gloo accepts a message
shorter than the receive posted, and aborts on a longer one), so ranks that disagree still
exchange safely sized messages, then raise. Larger movements run the same round with
headers alone, then the data; NCCL, whose message sizes must match exactly, runs a round of
headers alone before every movement.

Waits are bounded by ``config(timeout=...)`` where it is set: a rank that waits longer
raises ``CollectiveMismatchError`` naming the operation and, in the header round, the
ranks whose headers did not arrive.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from fshard._base.cache import cached
from fshard._base.calls import RECORD_ALIKE
from fshard._config import current
from fshard._errors import CollectiveMismatchError
from fshard._layout.layout import Layout, layout_digest
from fshard._layout.show import describe_layout
from fshard._plan import plan

from ._reduce_phase import all_to_all
from ._watch import handed, timed_out

__all__ = ["HEADER", "Guard", "guard", "inline_bytes"]

HEADER = 24  # a multiple of 8: the data behind it stays aligned
# A round of headers in flight: its receive buffer (numpy for a Gloo round) and its Work.
Round = tuple[np.ndarray | torch.Tensor, Any]
_TAG = b"fS"  # the first two bytes of every header: a receive slot without it got no header
# Header fields after the tag: (name, byte range); the dtype is a code into ``_DTYPES``, its top bit
# (``_GRAD``) set where the movement records a gradient and every rank holds blocks of its source; the
# last, where it does and moves a tree's leaves as one, ``recording_leaves``'s digest (else zeros).
_LEAVES = "which leaves of the tree moved as one record a gradient"
_OPERATION = "operation (or the tree of arrays it moves a part of)"
_FIELDS = (("dtype", slice(2, 4)), (_OPERATION, slice(4, 8)), ("source layout", slice(8, 12)),
           ("destination layout", slice(12, 16)), (_LEAVES, slice(16, 24)))  # fmt: skip
_GRAD = 1 << 15
# What to do where ranks would record a gradient through one movement and not all of them would.
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_CPU = torch.device("cpu")
# A peer's segment carries up to this many bytes of data behind its header, and every rank's
# receive buffer holds at most about ``_INLINE_TOTAL`` bytes, whatever the group's size.
_INLINE_MAX = 64 << 10
_INLINE_TOTAL = 1 << 20


def inline_bytes(world: int) -> int:
    """Bytes of data that may follow a header in one segment of the round (alike on every rank)."""
    return min(_INLINE_MAX, _INLINE_TOTAL // max(world, 1))


@dataclasses.dataclass(frozen=True, eq=False)
class Guard:
    """One movement's header and how its round runs.

    ``inline`` (the data follows the headers in one ``all_to_all_single``) or headers alone
    first. Made once per movement (``guard``).
    """

    op: str
    src: Layout
    dst: Layout
    dtype: torch.dtype
    ranks: tuple[int, ...]
    rank: int
    wire: torch.device
    alltoall: bool
    inline: bool
    header: np.ndarray
    tiled: torch.Tensor  # the header once per rank, on the wire: the send buffer of a header round
    slots: tuple[int, ...]  # bytes received from each rank in a Gloo round (from itself: a header)
    at: np.ndarray  # where each rank's header lands in the round's receive buffer, (ranks, HEADER)
    data_at: tuple[int, ...]  # where the data from each rank starts in that buffer
    expect: bytes  # the header once per rank: what a round that agrees receives

    def start(
        self,
        recvbuf: torch.Tensor,
        sendbuf: torch.Tensor,
        recv_split: Any,
        send_split: Any,
        group: Any,
        opened: Round | None = None,
        *,
        own: bool = False,
    ) -> Any:
        """Starts the movement's ``all_to_all_single`` (as ``_reduce.all_to_all``).

        Inline behind the headers, or after the round of headers (``opened``, else one started
        here). Returns an object whose ``wait()`` checks the headers. ``own``: an inline round
        receives into a buffer of its own, not the thread's shared one (it stays in flight
        while other rounds run: a launched movement).
        """
        if not self.inline:
            self.agree(group, opened)
            return _Bounded(self, all_to_all(recvbuf, sendbuf, recv_split, send_split, group))
        item = sendbuf.element_size()
        sends = [n * item for n in send_split]
        if max(sends, default=0) > max(self.slots) - HEADER or sends[self.ranks.index(self.rank)]:
            raise RuntimeError(f"fshard internal error: {self.op} sends {sends} bytes inline, past the bound.")
        check_launched()
        box, work, env = self._round(_bytes(sendbuf), sends, group, own=own)
        started = _Inline(self, work, box, [n * item for n in recv_split], recvbuf, env)
        if own:  # launched: left in flight while other movements run
            with _LAUNCHED_LOCK:
                _LAUNCHED.append(started)
        return started

    def open(self, group: Any) -> Round | None:
        """Starts the round of headers alone, so that it is in flight while the caller packs.

        ``None`` for an inline movement, whose round is its data's; ``agree`` ends it.
        """
        return None if self.inline else self._alone(group)

    def _alone(self, group: Any) -> Round:
        """Starts a round of headers alone (also for an inline movement that ends in another collective)."""
        check_launched()
        if self.wire.type == "cpu" and self.alltoall:
            box, work, _ = self._round(None, (), group)
            return box, work
        got = torch.empty((len(self.ranks), HEADER), dtype=torch.uint8, device=self.wire)
        view, header = handed(got.view(-1), self.tiled if self.alltoall else self.tiled[:HEADER])
        if self.alltoall:
            work = cast("dist.Work", dist.all_to_all_single(view, header, group=group, async_op=True))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
        else:
            work = cast(
                "dist.Work",
                dist.all_gather_into_tensor(view, header, group=group, async_op=True),  # pyright: ignore[reportUnknownMemberType, reportDeprecated]  # untyped in torch; older torch lacks all_gather_single
            )
        return got, work

    def agree(self, group: Any, opened: Round | None = None) -> None:
        """Ends the round of headers ``opened`` (or a round started here).

        Returns when every rank sent this movement's header.
        """
        got, work = opened or self._alone(group)  # a round of its own where no data round carries them
        if isinstance(got, np.ndarray):  # a Gloo round
            self.wait(work, got)
            self.verify(got[self.at])
        else:
            self.wait(work)
            self.verify(got.cpu().numpy())

    def _round(
        self, data: np.ndarray | None, sends: Sequence[int], group: Any, *, own: bool = False
    ) -> tuple[np.ndarray, Any, torch.Tensor]:
        """Posts one Gloo round: a header, then the next ``sends[k]`` bytes of ``data`` (if given), to the k-th rank.

        Every rank receives ``slots[k]`` bytes from the k-th, so no message is longer than its
        receive (Gloo requires a rank's segment to itself to be exactly as long as sent: a header).
        Returns the receive buffer, the round's ``Work`` and its send buffer (kept alive until
        the wait). ``own``: a receive buffer of its own (``start``).
        """
        if data is None:
            env, sizes = self.tiled, [HEADER] * len(self.ranks)
        else:
            parts: list[np.ndarray] = []
            at = 0
            for n in sends:  # numpy slices: a tenth of the cost of torch's split and cat
                parts += (self.header, data[at : at + n])
                at += n
            env, sizes = torch.from_numpy(np.concatenate(parts)), [HEADER + n for n in sends]  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
        box, wire = _fresh(sum(self.slots)) if own else _box(sum(self.slots))
        if current().timeout is not None:
            box[self.at[:, :2]] = 0  # a header that still lacks its tag after a timeout: that rank did not arrive
        into, sent = handed(wire, env)
        start = cast("Any", dist.all_to_all_single)  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
        work = cast("dist.Work", start(into, sent, list(self.slots), sizes, group=group, async_op=True))
        return box, work, env

    def verify(self, got: np.ndarray) -> None:
        """Raises ``CollectiveMismatchError`` unless every row of ``got`` is this movement's header."""
        if got.tobytes() != self.expect:
            raise self._mismatch(got)

    def wait(self, work: Any, box: np.ndarray | None = None, deadline: float | None = None) -> None:
        """``work.wait()``, at most ``config(timeout=...)`` seconds (or until ``deadline``) where set."""
        timeout = current().timeout
        if timeout is None:
            work.wait()
            return
        left = timeout if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as exc:
            if not timed_out(exc):
                raise
            if box is not None:  # still in flight: the next round must not receive into it
                _BOXES.by_size.pop(box.size, None)
            raise self._late(timeout, box) from exc

    def wait_all(self, works: Sequence[Any], deadline: float | None = None) -> None:
        """Every ``work.wait()``, all within one ``config(timeout=...)`` (or until ``deadline``, ``deadline()``'s)."""
        deadline = self.deadline() if deadline is None else deadline
        for work in works:
            self.wait(work, deadline=deadline)

    def deadline(self) -> float | None:
        """When a wait that starts now runs out of ``config(timeout=...)`` (``None``: no timeout)."""
        timeout = current().timeout
        return None if timeout is None else time.monotonic() + timeout

    def _late(self, timeout: float, box: np.ndarray | None) -> CollectiveMismatchError:
        try:  # a launched round that the others met with another movement: that, not their absence, is the error
            check_launched()
        except CollectiveMismatchError as mismatch:
            return mismatch
        who = f"some ranks of process group {list(self.ranks)}"
        if box is not None:
            tags = box[self.at[:, :2]]
            missing = [r for k, r in enumerate(self.ranks) if r != self.rank and tags[k].tobytes() != _TAG]
            if missing:
                who = f"ranks {missing} of process group {list(self.ranks)}"
        msg = (
            f"{self.op}: {who} did not arrive within {timeout:g} s (config(timeout=...)): they are "
            "stopped, slower than this rank, or called fewer fshard functions (every rank must call "
            "each one, in the same order). The collective stays in flight, so this process group "
            "cannot be used again: end the job or destroy the group; raise config(timeout=...) if "
            "those ranks are only slow."
        )
        return CollectiveMismatchError(msg)

    def _mismatch(self, got: np.ndarray) -> CollectiveMismatchError:
        sent: dict[bytes, list[int]] = {}
        for r, row in zip(self.ranks, got):
            sent.setdefault(row.tobytes(), []).append(r)
        differ = [name for name, at in _FIELDS if len({_field(h, at) for h in sent}) > 1]
        if len({_grad_of(h) for h in sent}) > 1:
            differ.append("whether it records a gradient")
        lines = "; ".join(f"ranks {rs} sent {_describe(h)}" for h, rs in sent.items())
        msg = (
            f"{self.op}: ranks called it with different arguments on process group {list(self.ranks)}, "
            f"so no data was read: {lines} (they differ in {', '.join(differ) or 'the tag'}). This rank "
            f"({self.rank}) moved {_name(self.dtype)} from {describe_layout(self.src)} to "
            f"{describe_layout(self.dst)}. Every rank must call each fshard function with the same "
            "arguments, in the same order (SPMD); config(check_collectives=True) names the calls."
        )
        if "whether it records a gradient" in differ or _LEAVES in differ:
            msg += f" Some ranks record a gradient through it and others do not: {RECORD_ALIKE}"
        return CollectiveMismatchError(msg)


@dataclasses.dataclass(frozen=True)
class _Bounded:
    """A started collective whose ``wait()`` is bounded."""

    guard: Guard
    work: Any

    def wait(self) -> None:
        self.guard.wait(self.work)


@dataclasses.dataclass(frozen=True, eq=False)
class _Inline:
    """A started inline round: ``wait()`` checks every header, then copies the data into ``into``."""

    guard: Guard
    work: Any
    box: np.ndarray
    sizes: list[int]
    into: torch.Tensor
    sent: torch.Tensor  # the round's send buffer, alive until the wait

    def wait(self) -> None:
        with _LAUNCHED_LOCK:
            if self in _LAUNCHED:
                _LAUNCHED.remove(self)
        g, box = self.guard, self.box
        g.wait(self.work, box)
        g.verify(box[g.at])
        parts = [box[a : a + n] for a, n in zip(g.data_at, self.sizes) if n]
        if parts:
            np.concatenate(parts, out=_bytes(self.into))


# The launched inline rounds in flight (``start(own=True)``), whose headers are checked at their wait.
_LAUNCHED: list[_Inline] = []
_LAUNCHED_LOCK = threading.Lock()


def check_launched() -> None:
    """Checks the headers of the launched rounds in flight that have completed, before another round starts.

    A rank that launched a movement the others did not make (a prefetch on one rank) has its
    round met by the others' next movement: they raise at once, and without this check it
    would go on to its own next movement, which no other rank joins, and wait there until
    ``config(timeout=...)`` ran out, naming the others as late.

    Raises:
        CollectiveMismatchError: a completed round's headers differ (``Guard.verify``).
    """
    if not _LAUNCHED:
        return
    with _LAUNCHED_LOCK:
        done = [r for r in _LAUNCHED if r.work.is_completed()]
        _LAUNCHED[:] = [r for r in _LAUNCHED if r not in done]  # checked once here (and again at its wait)
    for r in done:
        r.guard.verify(r.box[r.guard.at])


@cached(512)
def guard(
    op: str,
    src: Layout,
    dst: Layout,
    dtype: torch.dtype,
    ranks: tuple[int, ...],
    rank: int,
    wire: torch.device,
    alltoall: bool,
    grad: bool = False,
    leaves: int = 0,
    tree: int = 0,
) -> Guard:
    """The ``Guard`` of moving ``dtype`` data from ``src`` to ``dst`` by ``op`` on the group of ``ranks``.

    ``grad``: the movement records a gradient on this rank. The header says so where every
    rank of the group holds blocks of ``src``, whose own blocks say it; a rank that holds
    none reads it from a link that follows what another rank's function returned only as far
    as that function's exchange tells it (not a ``requires_grad_()`` set by hand on the blocks,
    not under ``torch.func`` transforms), so there it says nothing. ``leaves``: for a tree's
    leaves moved as one, ``recording_leaves``'s digest of which record a gradient here, which
    the header carries where it says the movement records one. ``tree``: for one of several
    movements of a tree, the tree's digest (``moving_tree``), in the operation's.
    """
    marked = grad and set(ranks) <= set(src.ranks)
    code = (_DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0) | (_GRAD if marked else 0)
    op_digest = hashlib.blake2b(f"{op} {tree}".encode() if tree else op.encode(), digest_size=4).digest()
    header = np.frombuffer(
        _TAG
        + code.to_bytes(2, "little")
        + op_digest
        + layout_digest(src)[:4]
        + layout_digest(dst)[:4]
        + (leaves if marked else 0).to_bytes(8, "little"),
        np.uint8,
    )
    sent = plan(src, dst).min_elements_sent * dtype.itemsize
    inline = wire.type == "cpu" and alltoall and 0 < sent <= inline_bytes(len(ranks))
    tiled = torch.from_numpy(np.tile(header, len(ranks))).to(wire)  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
    n = len(ranks)
    slot = HEADER + (inline_bytes(n) if wire.type == "cpu" and alltoall else 0)
    slots = [slot] * n
    if rank in ranks:
        slots[ranks.index(rank)] = HEADER
    at = (np.cumsum(slots) - slots)[:, None] + np.arange(HEADER)
    data_at = tuple((at[:, 0] + HEADER).tolist())
    expect = header.tobytes() * n
    return Guard(
        op, src, dst, dtype, ranks, rank, wire, alltoall, inline, header, tiled, tuple(slots), at, data_at, expect
    )


# Each thread's receive buffers of Gloo rounds, by size: a round is waited for before the next
# starts on the same thread, so one buffer serves them all (a fresh one would be mapped and
# faulted in on every call past malloc's mmap threshold, 128 KiB).
_BOXES = threading.local()


def _box(size: int) -> tuple[np.ndarray, torch.Tensor]:
    """This thread's receive buffer of ``size`` bytes, as numpy and as torch (one memory)."""
    boxes: dict[int, tuple[np.ndarray, torch.Tensor]] | None = getattr(_BOXES, "by_size", None)
    if boxes is None:
        boxes = _BOXES.by_size = {}
    found = boxes.get(size)
    if found is None:
        box = np.empty(size, np.uint8)
        found = boxes[size] = (box, torch.from_numpy(box))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
    return found


def _fresh(size: int) -> tuple[np.ndarray, torch.Tensor]:
    """A receive buffer of ``size`` bytes of its own, as numpy and as torch (one memory)."""
    box = np.empty(size, np.uint8)
    return box, torch.from_numpy(box)  # pyright: ignore[reportUnknownMemberType]  # untyped in torch


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous 1-D CPU tensor's bytes as a numpy view (numpy's views cost less than torch's)."""
    try:
        return t.numpy().view(np.uint8)
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or a tensor that requires grad
        return t.detach().view(torch.uint8).numpy()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(h: bytes) -> str:
    """A header as words: the dtype by name, the digests in hex."""
    if h[:2] != _TAG:
        return "no fshard movement header (another collective?)"
    code = int.from_bytes(h[2:4], "little")
    grad, code = code & _GRAD, code & ~_GRAD
    dtype = _name(_DTYPES[code - 1]) if 0 < code <= len(_DTYPES) else f"dtype #{code}"
    recorded = " (recording a gradient)" if grad else ""
    leaves = f", recording leaves #{h[16:24].hex()}" if any(h[16:24]) else ""
    return (
        f"{dtype}{recorded}, operation #{h[4:8].hex()}, source #{h[8:12].hex()}, destination #{h[12:16].hex()}{leaves}"
    )


def _field(h: bytes, at: slice) -> bytes:
    """A header's field at ``at`` (the dtype without the gradient's bit)."""
    if at.start == 2 and h[:2] == _TAG:
        return (int.from_bytes(h[2:4], "little") & ~_GRAD).to_bytes(2, "little")
    return h[at]


def _grad_of(h: bytes) -> bool | None:
    """Whether a header's movement records a gradient; ``None`` for no fshard header."""
    return bool(int.from_bytes(h[2:4], "little") & _GRAD) if h[:2] == _TAG else None
