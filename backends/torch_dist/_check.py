"""Check mode for ``torch_dist``: the ranks agree on every call, or every rank raises.

A check is one round on the process group's rendezvous store (the key-value store
that ``init_process_group`` made; not the data path). Each rank posts what it is
about to do, a description of the call and collective, or the error it hit instead,
under the group's next sequence number; then it waits for every rank's entry, at
most ``config(check_timeout=...)`` seconds, and reads them all. Every rank reads the
same entries, so every rank comes to the same verdict:

- a rank posted an error: that rank raises its own; every other rank raises a copy,
  with a note naming the rank (``agreed`` marks both, so no second round follows);
- the descriptions differ: every rank raises ``CollectiveMismatchError`` naming which
  ranks called what;
- a rank did not post in time: the others raise ``CollectiveMismatchError`` naming
  the missing ranks.

A rank reads the entries of the others, so a round costs O(world) store reads per
rank: check mode is for finding bugs, not for production runs at scale. Entries two
rounds old are deleted (every rank that posts round n has read round n - 2).

Entries are data (``_wire``), never pickles: the store listens on every interface, so
whatever is read from it is decoded as untrusted input, and an entry that is not one
fshard wrote raises ``CollectiveMismatchError`` on every rank that reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import time
import weakref
from collections.abc import Generator
from typing import Any, cast

import torch.distributed as dist

from fshard._config import current
from fshard._errors import CollectiveMismatchError, as_error

from ._wire import decode, encode, refuse

__all__ = ["agreed", "broke_in_flight", "check", "in_flight"]


@dataclasses.dataclass
class _Channel:
    name: str
    seq: int = 0
    announced: bool = False  # this rank has posted that it runs checks on this channel


_CHANNELS: weakref.WeakKeyDictionary[Any, _Channel] = weakref.WeakKeyDictionary()
_CHANNELS_LOCK = threading.Lock()  # threads that drive different groups create channels at once


def agreed(exc: BaseException) -> bool:
    """Whether every rank raises ``exc`` (or its copy) already: a check raised it."""
    return getattr(exc, "_fshard_agreed", False)


def broke_in_flight(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective while its messages were in flight (``in_flight``)."""
    return getattr(exc, "_fshard_in_flight", False)


@contextlib.contextmanager
def in_flight() -> Generator[None, None, None]:
    """Marks what the collective in the block raises: a peer is gone or the group is broken.

    The other ranks are inside that collective, not at the store, so a check round
    after it would only wait out ``check_timeout``; the call that ends settles at once.
    """
    try:
        yield
    except BaseException as exc:
        exc._fshard_in_flight = True  # type: ignore[attr-defined]
        raise


def check(group: Any, ranks: tuple[int, ...], rank: int, what: str, error: BaseException | None = None) -> None:
    """One check round on ``group``: ``what`` this rank is about to do, or the ``error`` it hit.

    Returns when every rank posted the same ``what`` and no rank an error; with
    ``error`` given, returns once every rank has learned of it (the caller raises it).
    Entries are data (``_wire``); one that is not raises, never runs.

    Raises:
        CollectiveMismatchError: the ranks posted different calls, some did not post
            within ``check_timeout`` seconds, or an entry on the store is not one fshard wrote.
        Exception: a copy of the error another rank posted.
    """
    channel = _channel(group, ranks)
    n, channel.seq = channel.seq, channel.seq + 1
    store = _store()
    base = f"fshard/check/{channel.name}/"
    if not channel.announced:  # lets a rank that waits in vain tell "check mode off there" from "late"
        store.set(f"{base}checking/{rank}", b"1")
        channel.announced = True
    store.set(f"{base}{n}/{rank}", encode((what, error)))
    if n >= 2:
        store.delete_key(f"{base}{n - 2}/{rank}")
    keys = [f"{base}{n}/{r}" for r in ranks]
    _wait(store, base, keys, ranks, what)
    entries = [_entry(v, k, r) for v, k, r in zip(store.multi_get(keys), keys, ranks)]
    if error is not None:
        return
    for r, (w, err) in zip(ranks, entries):
        if err is not None:
            err = as_error(err, r, w.removesuffix(" raised"))
            err.add_note(f"(raised on rank {r}; rank {rank} was at {what})")
            raise _agree(err)
    calls: dict[str, list[int]] = {}
    for r, (w, _) in zip(ranks, entries):
        calls.setdefault(w, []).append(r)
    if len(calls) > 1:
        lines = "; ".join(f"ranks {rs} called {c}" for c, rs in calls.items())
        msg = (
            f"Ranks called different collectives on process group {list(ranks)}: {lines}. Every rank must call "
            "each fshard function with the same arguments, in the same order (SPMD)."
        )
        raise _agree(CollectiveMismatchError(msg))


def _wait(store: Any, base: str, keys: list[str], ranks: tuple[int, ...], what: str) -> None:
    """Waits for every rank's entry; raises naming the ranks whose entry is missing, and why it may be.

    Polls rather than ``store.wait``: the store client is one connection per process, and a
    blocking wait would hold it, so that another thread's check (on another group) could
    not post its entry until this one timed out.
    """
    timeout = current().check_timeout
    deadline, pause = time.monotonic() + timeout, 1e-4
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
            if not missing:  # every entry arrived just as the wait ran out
                return
            off = [r for r in missing if not store.check([f"{base}checking/{r}"])]
            late = [r for r in missing if r not in off]
            raise _agree(CollectiveMismatchError(_missing_message(ranks, what, timeout, off, late)))
        time.sleep(pause)
        pause = min(2 * pause, 0.005)


def _missing_message(ranks: tuple[int, ...], what: str, timeout: float, off: list[int], late: list[int]) -> str:
    why: list[str] = []
    if off:
        why.append(
            f"ranks {off} never posted a check on this process group: check mode is off there (call "
            "fshard.config(check_collectives=True) on every rank), or they have not reached any checked call"
        )
    if late:
        why.append(f"ranks {late} called fewer fshard functions than this rank, are stopped, or are still running")
    return (
        f"Check mode: ranks {sorted(off + late)} of process group {list(ranks)} did not reach {what} within "
        f"{timeout:g} s (config(check_timeout=...)): {'; '.join(why)}. Every rank must call each fshard function, "
        "in the same order (SPMD), all in check mode."
    )


def _entry(value: bytes, key: str, rank: int) -> tuple[str, BaseException | None]:
    """A check entry read from the store: untrusted bytes, decoded as data and schema-checked."""
    source = f"the rendezvous store (key {key!r}, rank {rank}'s check entry)"
    try:
        entry = cast("tuple[Any, ...]", decode(value, source))  # checked below
    except CollectiveMismatchError as exc:  # every rank read the same bytes, so every rank raises this
        raise _agree(exc) from None
    if not (
        type(entry) is tuple
        and len(entry) == 2
        and type(entry[0]) is str
        and (entry[1] is None or isinstance(entry[1], BaseException))
    ):
        raise _agree(refuse(source, f"not a (description, error) pair: {str(entry)[:80]}"))
    return entry


def _agree(exc: BaseException) -> BaseException:
    exc._fshard_agreed = True  # type: ignore[attr-defined]
    return exc


def _channel(group: Any, ranks: tuple[int, ...]) -> _Channel:
    pg = group if group is not None else dist.group.WORLD
    with _CHANNELS_LOCK:
        channel = _CHANNELS.get(pg)
        if channel is None:
            name = getattr(pg, "group_name", "") or hashlib.blake2b(repr(ranks).encode(), digest_size=8).hexdigest()
            channel = _CHANNELS[pg] = _Channel(name)
    return channel


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()  # pyright: ignore[reportPrivateUsage]  # no public accessor in torch
