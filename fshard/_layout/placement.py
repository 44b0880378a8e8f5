"""Placements: which rank (and which device on it) owns a shard."""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any, Union

import numpy as np
import torch

from fshard._errors import SpecError

__all__ = ["Placement", "PlacementLike", "as_placement"]

# Arguments are checked at run time whatever their annotations say: callers may be untyped.
# pyright: reportUnnecessaryIsInstance=false

_RANK_RE = re.compile(r"^rank:(\d+)(?:/(.+))?$")


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Placement:
    """The owner of a shard: a global rank and a device on that rank.

    Args:
        rank: global rank of the owning process.
        device: torch device string on that rank, ``"cpu"`` or ``"cuda:1"``.

    >>> p = Placement.parse("rank:1/cuda:1")
    >>> p
    Placement(rank=1, device='cuda:1')
    >>> str(p)
    'rank:1/cuda:1'
    >>> Placement.parse(str(p)) == p
    True
    """

    rank: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise SpecError(f"Placement rank must be a non-negative int, got {self.rank!r}.")
        if self.rank >= 2**63 - 1:  # a rank's end (rank + 1) must fit too
            raise SpecError(f"Placement rank must be below 2**63 - 1 (layouts hold ranks as int64), got {self.rank!r}.")
        if not isinstance(self.device, str):
            raise SpecError(f"Placement device must be a str such as 'cpu', got {self.device!r}.")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            msg = f"Placement device {self.device!r} is not a torch device string such as 'cuda:0'."
            raise SpecError(msg) from exc
        object.__setattr__(self, "device", str(device))

    @classmethod
    def parse(cls, text: str) -> Placement:
        """Parses ``"rank:R/DEVICE"`` (or ``"rank:R"``, on cpu), the seed's placement strings.

        Raises:
            SpecError: for RPC worker names (``"worker0/cuda:1"``) or any other form.
        """
        match = _RANK_RE.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            hint = ""
            if isinstance(text, str) and not text.startswith("rank:"):
                hint = (
                    " RPC worker names are not supported: fshard has no RPC; remote shards"
                    " are reached with gather() or reshard()."
                )
            msg = f"Invalid placement {text!r}: expected 'rank:<int>/<device>'.{hint}"
            raise SpecError(msg)
        return cls(int(match.group(1)), match.group(2) or "cpu")

    def __str__(self) -> str:
        return f"rank:{self.rank}/{self.device}"


PlacementLike = Union[Placement, str, int]


def as_placement(value: PlacementLike) -> Placement:
    """Converts a ``Placement``, a seed string, a plain int or torch's ``_remote_device`` to a ``Placement``.

    A plain int (or a numpy one) is a rank on cpu; a ``_remote_device`` is what ``ChunkShardingSpec`` turns its
    strings into.

    >>> from torch.distributed.remote_device import _remote_device
    >>> as_placement(_remote_device("rank:1/cuda:1"))
    Placement(rank=1, device='cuda:1')
    """
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        return Placement.parse(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return Placement(value)
    if isinstance(value, np.integer):  # np.arange(4) as a list of ranks
        return Placement(int(value))
    if _is_remote_device(value):
        return _from_remote_device(value)
    raise SpecError(
        f"Cannot read {value!r} ({type(value).__name__}) as a placement: "
        "give a Placement, a string like 'rank:0/cuda:0', or an int rank."
    )


def _is_remote_device(value: Any) -> bool:
    # One can only exist once its module is loaded: fshard never imports torch.distributed for it.
    module = sys.modules.get("torch.distributed.remote_device")
    return module is not None and isinstance(value, module._remote_device)


def _from_remote_device(remote: Any) -> Placement:
    rank = remote.rank()
    if rank is None:
        msg = (
            f"Placement {remote} (a torch _remote_device) names an RPC worker, not a rank: fshard has no RPC; "
            f"write it as 'rank:<int>/{remote.device()}'."
        )
        raise SpecError(msg)
    return Placement(rank, str(remote.device()))
