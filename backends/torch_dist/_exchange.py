"""Small metadata exchanges: every rank's encoded value (``_wire``, data only), in one round where they are small."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from fshard._config import current
from fshard._errors import CollectiveMismatchError, SpecError

from ._check import in_flight
from ._choice import has_alltoall
from ._watch import handed, timed_out
from ._wire import MAX_BYTES, Unsendable, decode, encode, refuse

# ``exchange`` sends encodings up to this many bytes in one round (larger: a second round).
_EXCHANGE_INLINE = 1016


def outside_transforms() -> Any:
    """A context in which torch.func transforms do not wrap new tensors.

    ``exchange`` moves metadata, never differentiated values; inside ``torch.func.grad``
    its wire tensors would otherwise be wrapped, and a collective cannot read a wrapper.
    """
    return torch._C._DisableFuncTorch()  # pyright: ignore[reportPrivateUsage]  # torch has no public form


def gather_objects(obj: Any, group: Any, n: int, wire: torch.device, ranks: Any = None) -> list[Any]:
    """``all_gather_object`` in one round where every encoding is small (metadata).

    Each rank sends a fixed-size record: its encoding's length and, when it fits, the
    encoding itself. Only if some rank's encoding is larger (every rank sees the lengths)
    does a second round carry them, padded to the longest. Values are data (``_wire``):
    what a peer sent is decoded, never unpickled.

    Raises:
        SpecError: ``obj`` is not data that ``_wire.encode`` takes (on this rank, before sending).
        CollectiveMismatchError: a peer sent a length or bytes that are not an encoded value.
    """
    failure = None
    try:
        data = encode(obj)
    except SpecError as exc:  # the others learn of it from the exchange, rather than wait for this rank
        data, failure = encode(Unsendable(str(exc))), exc
    record = np.zeros(8 + _EXCHANGE_INLINE, np.uint8)
    record[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
    if len(data) <= _EXCHANGE_INLINE:
        record[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
    got = _all_gather_bytes(record, group, n, wire)
    sizes = got[:, :8].copy().view(np.int64).ravel().tolist()
    names = [f"rank {r}" for r in ranks] if ranks is not None else [f"group rank {i}" for i in range(n)]
    for name, k in zip(names, sizes):
        if not 0 <= k <= MAX_BYTES:  # before a second round allocates max(sizes) bytes
            raise refuse(name, f"a length of {k} bytes (0 to {MAX_BYTES})", peer=True)
    if max(sizes) <= _EXCHANGE_INLINE:
        out = [decode(got[i, 8 : 8 + k].tobytes(), names[i], peer=True) for i, k in enumerate(sizes)]
    else:
        padded = np.zeros(max(sizes), np.uint8)
        padded[: len(data)] = np.frombuffer(data, np.uint8)
        rows = _all_gather_bytes(padded, group, n, wire)
        out = [decode(rows[i, :k].tobytes(), names[i], peer=True) for i, k in enumerate(sizes)]
    return _sendable(out, names, failure)


def _sendable(out: list[Any], names: list[str], failure: SpecError | None) -> list[Any]:
    """``out``, unless some rank could not encode its value: then that rank's error, on every rank."""
    if failure is not None:
        raise failure
    for name, value in zip(names, out):
        if isinstance(value, Unsendable):
            raise SpecError(f"{name} could not send its part of an exchange: {value.message}")
    return out


def _all_gather_bytes(row: np.ndarray, group: Any, n: int, wire: torch.device) -> np.ndarray:
    """Every rank's ``row`` (equal lengths), as an ``n x len`` array in group order.

    Through ``all_to_all_single`` where the backend has it: every message goes out at
    once, one step, where a ring all-gather takes n - 1 steps in turn (small messages
    are all latency: about 2 ms against 4 ms for 4 Gloo processes on 2 cores, and
    ``all_gather_object``, which gathers the sizes first, takes 8 ms).
    """
    mine = torch.from_numpy(row).to(wire)  # pyright: ignore[reportUnknownMemberType]  # torch's stub: untyped parameter
    out = torch.empty(n * row.size, dtype=torch.uint8, device=wire)
    with in_flight():
        if has_alltoall(str(dist.get_backend(group))):
            into, mine = handed(out, mine.repeat(n))
            work = cast("dist.Work", dist.all_to_all_single(into, mine, group=group, async_op=True))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
        else:
            into, mine = handed(out, mine)
            work = cast("dist.Work", dist.all_gather_into_tensor(into, mine, group=group, async_op=True))  # pyright: ignore[reportUnknownMemberType, reportDeprecated]  # untyped in torch; older torch lacks all_gather_single
        bounded_wait(work, "an exchange of metadata", group)
    return out.cpu().numpy().reshape(n, row.size)


def bounded_wait(work: Any, what: str, group: Any, late: Callable[[float], str] | None = None) -> None:
    """``work.wait()``, at most ``config(timeout=...)`` seconds where that is set.

    A rank that waits longer raises ``CollectiveMismatchError``: the others are stopped,
    slow, or made another call, and none of them will send what this collective waits for.
    ``late``: the message for the timeout (in seconds) where the caller has its own.
    """
    timeout = current().timeout
    if timeout is None:
        work.wait()
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        if not timed_out(exc):
            raise
        raise CollectiveMismatchError((late or functools.partial(_late, what, group))(timeout)) from exc


def _late(what: str, group: Any, timeout: float) -> str:
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return (
        f"{what}: some ranks of process group {ranks} did not arrive within {timeout:g} s (config(timeout=...)): "
        "they are stopped, slower than this rank, or called fewer fshard functions (every rank must call each "
        "one, in the same order). The collective stays in flight, so this process group cannot be used again: "
        "end the job or destroy the group; raise config(timeout=...) if those ranks are only slow."
    )
