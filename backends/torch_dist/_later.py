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

A wait is bounded by ``config(timeout=...)`` where it is set.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
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


@dataclasses.dataclass(frozen=True)
class _Check:
    what: str
    ranks: tuple[int, ...]
    width: int | None  # the numbers in a tuple digest; None: one number
    out: torch.Tensor
    work: Any
    verdict: Verdict


# Keyed on (group, default group), as the group's facts are: a new init_process_group starts afresh.
_PENDING: dict[tuple[Any, Any], list[_Check]] = {}
_LOCK = threading.Lock()  # the backward's thread may settle while the caller's thread posts
# all_gather_single replaces the deprecated all_gather_into_tensor where torch has it
_gather = cast(
    "Callable[..., Any]",
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,  # pyright: ignore[reportUnknownMemberType, reportDeprecated]  # untyped in torch; for older torch
)


def post(
    group: Any,
    ranks: tuple[int, ...],
    wire: torch.device,
    what: str,
    failed: bool,
    digest: int | tuple[int, ...],
    verdict: Verdict,
) -> None:
    """Posts this rank's ``(failed, digest)`` for the check ``what`` of ``group``, left in flight.

    Every rank posts a digest of one form at one check: a number, or a tuple of one length.
    """
    width = len(digest) if isinstance(digest, tuple) else None
    numbers = [int(failed), *(digest if isinstance(digest, tuple) else (digest,))]
    mine, out = handed(
        torch.tensor(numbers, dtype=torch.int64, device=wire),
        torch.empty(len(numbers) * len(ranks), dtype=torch.int64, device=wire),
    )
    work = _gather(out, mine, group=group, async_op=True)
    with _LOCK:
        _forget_old_groups()
        _PENDING.setdefault((group, dist.group.WORLD), []).append(_Check(what, ranks, width, out, work, verdict))


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
    """How many checks of ``group`` are in flight here."""
    return len(_PENDING.get((group, dist.group.WORLD), ()))


def settle(group: Any) -> None:
    """Ends every check of ``group`` in flight here, in the order posted.

    Raises:
        BaseException: the first error a check's verdict gives (on every rank alike).
        CollectiveMismatchError: a check's gather did not end within ``config(timeout=...)``.
    """
    if not _PENDING:  # the common case: one dict lookup
        return
    with _LOCK:
        _forget_old_groups()
        checks = _PENDING.pop((group, dist.group.WORLD), None)
    error: BaseException | None = None
    for check in checks or ():
        _wait(check)
        rows = cast("list[list[int]]", check.out.view(len(check.ranks), -1).tolist())  # pyright: ignore[reportUnknownMemberType]  # torch's stub
        digests = [row[1] if check.width is None else tuple(row[1:]) for row in rows]
        verdict = check.verdict([(r, bool(row[0]), d) for r, row, d in zip(check.ranks, rows, digests)])
        error = error or verdict
    if error is not None:
        error._fshard_agreed = True  # type: ignore[attr-defined]  # every rank raises it: no check round after
        raise error


def drop(group: Any) -> None:
    """Ends every check of ``group`` in flight here without its verdict: the call that posted them raised.

    Check mode's round at the end of that call has told every rank how it ended. Each rank
    posts its check before it raises, so the waits end; a rank that is stopped or slower
    than ``config(check_timeout=...)`` is waited for that long at most, as the round did.
    """
    with _LOCK:
        _forget_old_groups()
        checks = _PENDING.pop((group, dist.group.WORLD), None)
    for check in checks or ():
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
