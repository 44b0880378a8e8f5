"""Agreement checks that ride on a process group's next collective instead of waiting now.

A call that builds a value from what this rank alone knows, trusting that every rank
passed alike (``from_local_tensor(..., even=True)``: each rank's block the same size), must
still make every rank raise where they did not. A blocking round would make every rank wait
for the slowest one at that call. Instead each rank posts a digest of what it passed (one
number, or a tuple of them of a length fixed by the check) and whether it failed,
``(failed, digest)``, as one ``all_gather`` left in flight (``post``),
and the group's next collective (``settle``, which every movement, exchange and launch of
the ``torch_dist`` backend calls first) waits for it, by then long done, and hands every
rank's pair to the check's ``verdict``. Every rank reads the same pairs, so every rank
raises the same error there, or none does. A rank that failed posts its pair before it
raises, so no rank waits for it; it raises again at its next collective, with the others
(unless every rank failed: each has raised its own error). Under NCCL the check is ended at
once by the call that posts it (``TorchDistBackend.check_later``). Checks of a default group
destroyed since are dropped; so are those left at exit.

**Frames.** Each ``all_gather`` carries a frame of a fixed size per rank (``_FRAME``
numbers): a count, then records ``(tag, failed, width, digest...)``, the tag naming the
check's call. A check posted with ``defer=True`` (a batch's ``from_local_tensor``: a small
collective costs a millisecond of CPU per rank on Gloo) waits on this rank for the next
check posted or the next collective, and goes in that frame: one collective for both. A
rank whose own check failed posts at once, in a frame of its own; its frame is as large as
the others', which hold its record and those posted after it, so the gathers still pair up
one to one and no rank waits for it. A record that some rank's frame lacks, or holds for
another call, raises ``CollectiveMismatchError`` on the ranks that posted it.

A wait is bounded by ``config(timeout=...)`` where it is set.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from fshard._config import current
from fshard._errors import CollectiveMismatchError

from ._watch import handed

__all__ = ["Verdict", "drop", "pending", "post", "settle"]

# Every rank's (rank, failed, digest), in group order, to the error every rank raises (None: they agree). The
# digest is as posted: a number, or a tuple of numbers.
Verdict = Callable[[Sequence[tuple[int, bool, Any]]], BaseException | None]


_FRAME = 16  # numbers per rank in each posted gather: a count, then records (tag, failed, width, digest...)


@dataclasses.dataclass(frozen=True)
class _Record:
    what: str
    failed: bool
    digest: tuple[int, ...]
    width: int | None  # the numbers in a tuple digest; None: one number
    verdict: Verdict

    def numbers(self) -> list[int]:
        return [_tag(self.what), int(self.failed), len(self.digest), *self.digest]


@dataclasses.dataclass(frozen=True)
class _Check:
    """A posted frame: its records, in flight."""

    ranks: tuple[int, ...]
    records: tuple[_Record, ...]
    out: torch.Tensor
    work: Any

    @property
    def what(self) -> str:
        return self.records[0].what if len(self.records) == 1 else " and ".join(r.what for r in self.records)


@dataclasses.dataclass
class _Group:
    """A group's checks: those waiting for the next post (``queued``), and the frames in flight."""

    ranks: tuple[int, ...]
    wire: torch.device
    queued: list[_Record] = dataclasses.field(default_factory=lambda: list[_Record]())
    frames: list[_Check] = dataclasses.field(default_factory=lambda: list[_Check]())


# Keyed on (group, default group), as the group's facts are: a new init_process_group starts afresh.
_PENDING: dict[tuple[Any, Any], _Group] = {}
_LOCK = threading.Lock()  # the backward's thread may settle while the caller's thread posts
# all_gather_single replaces the deprecated all_gather_into_tensor where torch has it
_gather = cast(
    "Callable[..., Any]",
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,  # pyright: ignore[reportUnknownMemberType, reportDeprecated]  # untyped in torch; for older torch
)


@functools.cache
def _tag(what: str) -> int:
    """A number naming the function of the call ``what`` alike on every rank.

    The function's name only (``what`` up to its arguments, which ranks may spell otherwise:
    ``dim=-1`` and ``dim=1`` of 2-D blocks), hashed as Python's own hash would not be, alike
    in every process.
    """
    name = what.partition("(")[0]
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "big")


def post(
    group: Any,
    ranks: tuple[int, ...],
    wire: torch.device,
    what: str,
    failed: bool,
    digest: int | tuple[int, ...],
    verdict: Verdict,
    *,
    defer: bool = False,
) -> int:
    """Posts this rank's ``(failed, digest)`` for the check ``what`` of ``group``, left in flight.

    Every rank posts a digest of one form at one check: a number, or a tuple of one length
    (at most ``_FRAME - 4`` numbers). ``defer``: unless it failed, the check waits for the
    next one posted, or the group's next collective, and goes with it. Returns the number of
    gathers started (0, 1, or 2 where the checks waiting fill a frame).
    """
    numbers = digest if isinstance(digest, tuple) else (digest,)
    if len(numbers) > _FRAME - 4:
        raise ValueError(f"A check's digest holds at most {_FRAME - 4} numbers, got {len(numbers)}.")
    record = _Record(what, failed, numbers, len(numbers) if isinstance(digest, tuple) else None, verdict)
    with _LOCK:
        _forget_old_groups()
        state = _PENDING.setdefault((group, dist.group.WORLD), _Group(ranks, wire))
        if defer and not failed:
            state.queued.append(record)
            return 0
        # A failed check goes at once, with those waiting: the others' frame holds them, this one and those after.
        batches = _frames([*state.queued, record])
        state.queued = []
        state.frames.extend(_launch(group, state, records) for records in batches)
    return len(batches)


def _frames(records: list[_Record]) -> list[list[_Record]]:
    """``records`` cut into frames, in order, each as full as it can be.

    Ranks that posted the same records cut them alike, and a rank that posted the first of
    another rank's records cut those as that rank did.
    """
    out: list[list[_Record]] = [[]]
    used = 1
    for r in records:
        n = len(r.numbers())
        if used + n > _FRAME:
            out.append([])
            used = 1
        out[-1].append(r)
        used += n
    return out


def _launch(group: Any, state: _Group, records: list[_Record]) -> _Check:
    """One gather of this rank's frame of ``records``."""
    frame = [len(records), *(n for r in records for n in r.numbers())]
    frame += [0] * (_FRAME - len(frame))
    mine, out = handed(
        torch.tensor(frame, dtype=torch.int64, device=state.wire),
        torch.empty(_FRAME * len(state.ranks), dtype=torch.int64, device=state.wire),
    )
    work = _gather(out, mine, group=group, async_op=True)
    return _Check(state.ranks, tuple(records), out, work)


def _forget_old_groups() -> None:
    """Drops the checks of default groups destroyed since they were posted: no collective of theirs comes."""
    world = dist.group.WORLD
    for key in [k for k in _PENDING if k[1] is not world]:
        del _PENDING[key]


@atexit.register
def _forget_all() -> None:
    """At exit, the checks nobody will settle let go of their tensors (the exit waits for those)."""
    _PENDING.clear()


def pending(group: Any) -> int:
    """How many checks of ``group`` are in flight here, or waiting to go with the next."""
    state = _PENDING.get((group, dist.group.WORLD))
    return 0 if state is None else len(state.queued) + sum(len(c.records) for c in state.frames)


def settle(group: Any) -> int:
    """Ends every check of ``group`` posted here, in the order posted (those waiting go first, in one gather).

    Returns the number of gathers started (the checks that were waiting).

    Raises:
        BaseException: the first error a check's verdict gives (on every rank alike).
        CollectiveMismatchError: a check's gather did not end within ``config(timeout=...)``, or
            ranks posted checks of different calls.
    """
    if not _PENDING:  # the common case: one dict lookup
        return 0
    with _LOCK:
        _forget_old_groups()
        state = _PENDING.pop((group, dist.group.WORLD), None)
        batches = _frames(state.queued) if state is not None and state.queued else []
        if state is not None:
            state.frames.extend(_launch(group, state, records) for records in batches)
    error: BaseException | None = None
    for check in () if state is None else state.frames:
        _wait(check)
        rows = cast("list[list[int]]", check.out.view(len(check.ranks), _FRAME).tolist())  # pyright: ignore[reportUnknownMemberType]  # torch's stub
        for position, record in enumerate(check.records):
            error = error or _verdict(record, position, check.ranks, rows)
    if error is not None:
        error._fshard_agreed = True  # type: ignore[attr-defined]  # every rank raises it: no check round after
        raise error
    return len(batches)


def _verdict(record: _Record, position: int, ranks: tuple[int, ...], rows: list[list[int]]) -> BaseException | None:
    """The error of ``record`` (this rank's ``position``-th of its frame), given every rank's frame."""
    pairs: list[tuple[int, bool, Any]] = []
    tag = _tag(record.what)
    for rank, row in zip(ranks, rows):
        at, count = 1, row[0]
        for _ in range(min(position, count)):  # the records before it
            at += 3 + row[at + 2]
        if position >= count or row[at] != tag or row[at + 2] != len(record.digest):
            return CollectiveMismatchError(
                f"{record.what}: rank {rank} posted no check of this call where this rank did (it made another "
                "call there, or fewer): every rank must call each fshard function, in the same order."
            )
        digest = row[at + 3 : at + 3 + row[at + 2]]
        pairs.append((rank, bool(row[at + 1]), digest[0] if record.width is None else tuple(digest)))
    return record.verdict(pairs)


def drop(group: Any) -> None:
    """Ends every check of ``group`` in flight here without its verdict: the call that posted them raised.

    Check mode's round at the end of that call has told every rank how it ended. Each rank
    posts its check before it raises, so the waits end; a rank that is stopped or slower
    than ``config(check_timeout=...)`` is waited for that long at most, as the round did.
    Checks still waiting to go with the next are dropped with them (every rank drops alike).
    """
    with _LOCK:
        _forget_old_groups()
        state = _PENDING.pop((group, dist.group.WORLD), None)
    for check in () if state is None else state.frames:
        with contextlib.suppress(CollectiveMismatchError):  # the call's own error goes first
            _wait(check, current().check_timeout)


def _wait(check: _Check, timeout: float | None = None) -> None:
    timeout = current().timeout if timeout is None else timeout
    if timeout is None:
        check.work.wait()
        return
    try:
        check.work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower():
            raise
        msg = (
            f"{check.what}: some ranks of process group {list(check.ranks)} did not post their part of its "
            f"check within {timeout:g} s (config(timeout=...)): they are stopped, slower than this rank, or "
            "did not make that call (every rank must call each fshard function, in the same order)."
        )
        raise CollectiveMismatchError(msg) from exc
