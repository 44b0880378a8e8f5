"""Placements: which rank (and which device on it) owns a shard."""

from __future__ import annotations

import dataclasses
import re
from typing import Union

import torch

from fshard._errors import SpecError

__all__ = ["Placement", "PlacementLike", "as_placement"]

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
    """Converts a ``Placement``, a seed string or a plain int (rank on cpu) to a ``Placement``."""
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        return Placement.parse(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return Placement(value)
    raise SpecError(
        f"Cannot read {value!r} ({type(value).__name__}) as a placement: "
        "give a Placement, a string like 'rank:0/cuda:0', or an int rank."
    )
