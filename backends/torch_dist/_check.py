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
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import pickle
import weakref
from typing import Any

import torch.distributed as dist

from fshard._config import current
from fshard._errors import CollectiveMismatchError

__all__ = ["agreed", "check"]


@dataclasses.dataclass
class _Channel:
    name: str
    seq: int = 0


_CHANNELS: weakref.WeakKeyDictionary[Any, _Channel] = weakref.WeakKeyDictionary()


def agreed(exc: BaseException) -> bool:
    """Whether every rank raises ``exc`` (or its copy) already: a check raised it."""
    return getattr(exc, "_fshard_agreed", False)


def check(group: Any, ranks: tuple[int, ...], rank: int, what: str, error: Exception | None = None) -> None:
    """One check round on ``group``: ``what`` this rank is about to do, or the ``error`` it hit.

    Returns when every rank posted the same ``what`` and no rank an error; with
    ``error`` given, returns once every rank has learned of it (the caller raises it).

    Raises:
        CollectiveMismatchError: the ranks posted different calls, or some did not post
            within ``check_timeout`` seconds.
        Exception: a copy of the error another rank posted.
    """
    channel = _channel(group, ranks)
    n, channel.seq = channel.seq, channel.seq + 1
    store = _store()
    base = f"fshard/check/{channel.name}/"
    store.set(f"{base}{n}/{rank}", pickle.dumps((what, _portable(error))))
    if n >= 2:
        store.delete_key(f"{base}{n - 2}/{rank}")
    keys = [f"{base}{n}/{r}" for r in ranks]
    timeout = current().check_timeout
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # the store's timeout error
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        msg = (
            f"Check mode: ranks {missing} of process group {list(ranks)} did not reach {what} within "
            f"{timeout:g} s (config(check_timeout=...)): they called fewer fshard functions than this rank, "
            "or are still running; every rank must call each fshard function, in the same order (SPMD)."
        )
        raise _agree(CollectiveMismatchError(msg)) from exc
    entries = [pickle.loads(v) for v in store.multi_get(keys)]
    if error is not None:
        return
    for r, (_, err) in zip(ranks, entries):
        if err is not None:
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


def _agree(exc: BaseException) -> BaseException:
    exc._fshard_agreed = True  # type: ignore[attr-defined]
    return exc


def _channel(group: Any, ranks: tuple[int, ...]) -> _Channel:
    pg = group if group is not None else dist.group.WORLD
    channel = _CHANNELS.get(pg)
    if channel is None:
        name = getattr(pg, "group_name", "") or hashlib.blake2b(repr(ranks).encode(), digest_size=8).hexdigest()
        channel = _CHANNELS[pg] = _Channel(name)
    return channel


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _portable(exc: Exception | None) -> Exception | None:
    """``exc`` if it survives pickling, else a ``RuntimeError`` naming it."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
