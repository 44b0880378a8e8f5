"""Random draws of per-block functions in one process, as each rank's own process makes them.

Across processes each rank draws from a generator of its own (torch's global one), which
stands where the call found it: ranks seeded alike draw alike. In one process the bodies
of every rank run one after another and share one generator, so each would draw where the
previous one stopped, and a dropout mask (say) would differ from the one the same program
gives across processes. ``RankDraws`` gives each rank its own stream in one process: before
a rank's first body the generator is put back to where the call found it, before its later
bodies to where its previous body left it, and after the call it goes on from where the
lowest rank's bodies left it (as that rank's process would). The CPU generator, and the
generator of each CUDA device where CUDA is initialized.

>>> import torch
>>> torch.manual_seed(0)
<torch._C.Generator object at ...>
>>> draws = RankDraws()
>>> masks = []
>>> for rank in (0, 1):
...     draws.before(rank)
...     masks.append(torch.rand(3))
>>> draws.end()
>>> torch.equal(masks[0], masks[1])
True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RankDraws"]


def _state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class RankDraws:
    """The generator state of each rank whose bodies run in one process (module docstring); one per call."""

    __slots__ = ("by_rank", "current", "start")

    def __init__(self) -> None:
        self.start = _state()
        self.by_rank: dict[int, Any] = {}
        self.current: int | None = None

    def before(self, rank: int) -> None:
        """Puts back ``rank``'s state before one of its bodies runs."""
        if rank == self.current:
            return
        if self.current is not None:
            self.by_rank[self.current] = _state()
            _restore(self.by_rank.get(rank, self.start))
        self.current = rank  # the first body starts where the call found the generator

    def restart(self) -> None:
        """Every rank's bodies start again (they ran in part): the generator back where the call found it."""
        _restore(self.start)
        self.by_rank.clear()
        self.current = None

    def end(self) -> None:
        """After the call (it returned or raised): the generator goes on from the lowest rank's state."""
        if self.current is None:
            return
        self.by_rank[self.current] = _state()
        _restore(self.by_rank[min(self.by_rank)])
