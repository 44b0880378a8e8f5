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
check posted or the next collective, and goes in that frame: one collective for both. The
checks waiting fill at most ``_QUEUE`` numbers, so that the next check fits in their frame
(a deferred one that would pass that sends those waiting first, alike on every rank). A rank
whose own deferred check failed posts at once, with those waiting: its frame is the one
that holds that check on the other ranks (with the check posted after it there), so the
gathers still pair one to one and no rank waits for it where it stops. A record that some
rank's frame lacks, or holds for another call, raises ``CollectiveMismatchError`` on the ranks
that posted it. A rank that catches its own error and goes on makes calls that the others do
not make at that point, and its checks may then pair with theirs wrongly: let such an error
end the step on every rank (check mode compares every call).

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

from ._watch import handed, timed_out

__all__ = ["Verdict", "drop", "pending", "post", "settle"]

# Every rank's (rank, failed, digest), in group order, to the error every rank raises (None: they agree). The
# digest is as posted: a number, or a tuple of numbers.
Verdict = Callable[[Sequence[tuple[int, bool, Any]]], BaseException | None]


_FRAME = 16  # numbers per rank in each posted gather: a count, then records (tag, failed, width, digest...)
_DIGEST = 4  # numbers in a digest at most: a record holds at most 7
_QUEUE = _FRAME - 1 - (3 + _DIGEST)  # numbers of the checks waiting at most: any record posted next fits beside them


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
    (at most ``_DIGEST`` numbers). ``defer``: the check waits for the next one posted, or the
    group's next collective, and goes with it; where it failed, it goes at once (with those
    waiting), in the frame that the others' holds it in. Returns the number of gathers
    started (0, 1 or 2).
    """
    numbers = digest if isinstance(digest, tuple) else (digest,)
    if len(numbers) > _DIGEST:
        raise ValueError(f"A check's digest holds at most {_DIGEST} numbers, got {len(numbers)}.")
    record = _Record(what, failed, numbers, len(numbers) if isinstance(digest, tuple) else None, verdict)
    with _LOCK:
        _forget_old_groups()
        state = _PENDING.setdefault((group, dist.group.WORLD), _Group(ranks, wire))
        frames, state.queued = _cut(state.queued, record, defer)
        state.frames.extend(_launch(group, state, records) for records in frames)
    return len(frames)


def _cut(queued: list[_Record], record: _Record, defer: bool) -> tuple[list[list[_Record]], list[_Record]]:
    """The frames to post now, and the checks left waiting, when ``record`` is posted beside ``queued``.

    The checks waiting fill at most ``_QUEUE`` numbers, so that any check posted next fits in
    their frame: where a deferred one would pass that, those waiting go first, alike on every
    rank (the one where it failed too, which then posts it at once, with those still waiting).
    """
    frames: list[list[_Record]] = []
    if defer and queued and sum(len(r.numbers()) for r in [*queued, record]) > _QUEUE:
        frames.append(queued)
        queued = []
    if defer and not record.failed:
        return frames, [*queued, record]
    return [*frames, [*queued, record]], []


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


def settle(group: Any, launched: Callable[[int], None] | None = None) -> None:
    """Ends every check of ``group`` posted here, in the order posted (those waiting go first, in one gather).

    ``launched`` is told how many gathers this started (the checks that were waiting), before
    any wait.

    Raises:
        BaseException: the first error a check's verdict gives (on every rank alike).
        CollectiveMismatchError: a check's gather did not end within ``config(timeout=...)``, or
            ranks posted checks of different calls.
    """
    if not _PENDING:  # the common case: one dict lookup
        return
    with _LOCK:
        _forget_old_groups()
        state = _PENDING.pop((group, dist.group.WORLD), None)
        if state is not None and state.queued:
            state.frames.append(_launch(group, state, state.queued))
            if launched is not None:
                launched(1)
    error: BaseException | None = None
    for check in () if state is None else state.frames:
        _wait(check)
        rows = cast("list[list[int]]", check.out.view(len(check.ranks), _FRAME).tolist())  # pyright: ignore[reportUnknownMemberType]  # torch's stub
        for position, record in enumerate(check.records):
            error = error or _verdict(record, position, check.ranks, rows)
    if error is not None:
        error._fshard_agreed = True  # type: ignore[attr-defined]  # every rank raises it: no check round after
        raise error


def _verdict(record: _Record, position: int, ranks: tuple[int, ...], rows: list[list[int]]) -> BaseException | None:
    """The error of ``record`` (this rank's ``position``-th of its frame), given every rank's frame."""
    pairs: list[tuple[int, bool, Any]] = []
    tag = _tag(record.what)
    for rank, row in zip(ranks, rows):
        found = _record_at(row, position)
        if found is None or found[0] != tag or len(found[2]) != len(record.digest):
            return CollectiveMismatchError(
                f"{record.what}: rank {rank} posted no check of this call where this rank did (it made another "
                "call there, or fewer): every rank must call each fshard function, in the same order."
            )
        _, failed, digest = found
        pairs.append((rank, failed, digest[0] if record.width is None else digest))
    return record.verdict(pairs)


def _record_at(row: list[int], position: int) -> tuple[int, bool, tuple[int, ...]] | None:
    """The ``position``-th record of a rank's frame ``row``: (tag, failed, digest); ``None`` where it has none.

    A frame is read as posted; one that is not a frame (a gather paired wrongly) gives ``None``
    rather than an error of its own.
    """
    if not 0 <= position < row[0] <= _FRAME:
        return None
    at = 1
    for k in range(position + 1):
        if at + 3 > _FRAME or not 0 <= row[at + 2] <= _DIGEST or at + 3 + row[at + 2] > _FRAME:
            return None
        if k < position:
            at += 3 + row[at + 2]
    return row[at], bool(row[at + 1]), tuple(row[at + 3 : at + 3 + row[at + 2]])


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
        if not timed_out(exc):
            raise
        msg = (
            f"{check.what}: some ranks of process group {list(check.ranks)} did not post their part of its "
            f"check within {timeout:g} s (config(timeout=...)): they are stopped, slower than this rank, or "
            "did not make that call (every rank must call each fshard function, in the same order)."
        )
        raise CollectiveMismatchError(msg) from exc
