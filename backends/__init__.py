"""Backends execute plans: ``local`` keeps every rank in this process; ``torch_dist`` uses torch.distributed.

A backend is a small, hashable object implementing ``Backend``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from fshard.backends.local import LOCAL

if TYPE_CHECKING:
    from fshard._layout.layout import Layout
    from fshard._plan.direct import Plan

__all__ = ["Backend", "default_backend", "for_group"]


@runtime_checkable
class Backend(Protocol):
    """What fshard needs from an executor of plans.

    ``addressable`` names the shards whose data lives in this process; every
    ``tensors`` argument and result below lists exactly those, in layout order.
    """

    @property
    def name(self) -> str:
        """A short name: ``"local"`` or ``"torch_dist"``."""
        ...

    @property
    def rank(self) -> int | None:
        """This process's global rank, or ``None`` when it holds every rank (local)."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks this backend spans (0 for local: any placement is allowed)."""
        ...

    @property
    def spans_processes(self) -> bool:
        """Whether the ranks live in different processes (so they exchange data and metadata)."""
        ...

    def holds(self, rank: int) -> bool:
        """Whether this process holds the data placed on ``rank``."""
        ...

    def check_rank(self, rank: Any, what: str) -> int:
        """``rank`` as an int, or ``SpecError`` naming it when no rank of this backend has it.

        ``what`` names the argument: ``"src"``, ``"dst"``.
        """
        ...

    def addressable(self, layout: Layout) -> tuple[int, ...]:
        """Indices into ``layout.shards`` of the shards held by this process."""
        ...

    def check_layout(self, layout: Layout) -> None:
        """Raises if ``layout`` places a shard on a rank this backend cannot reach."""
        ...

    def execute(self, plan: Plan, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Runs ``plan``: addressable shards of ``plan.src`` in, of ``plan.dst`` out.

        ``like`` gives dtype (and device, where a shard's placement does not).
        """
        ...

    def scatter(
        self, full: torch.Tensor | None, layout: Layout, src: int | None, plan: Plan | None
    ) -> tuple[torch.Tensor, ...]:
        """Slices the global tensor into addressable shards.

        With ``src``, only that rank's tensor is read and ``plan`` moves the whole array on
        ``src`` (``fshard._layout.specs.whole``) to ``layout``; with ``src=None``, ``plan`` is ``None``.
        """
        ...

    def receivers(self, layout: Layout, dst: int | None) -> tuple[int, ...]:
        """The ranks that ``assemble`` delivers to: ``(dst,)``, or every rank (raises for a bad ``dst``)."""
        ...

    def assemble(
        self, layout: Layout, tensors: Sequence[torch.Tensor], like: torch.Tensor, dst: int | None, plan: Plan
    ) -> torch.Tensor | None:
        """The global tensor, on every rank (``dst=None``) or on rank ``dst`` (others ``None``).

        ``plan`` moves ``layout`` to the whole array on each of ``receivers(layout, dst)``.
        """
        ...

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small data: see ``torch_dist._wire`` for the kinds), in rank order."""
        ...


def default_backend() -> Backend:
    """``torch_dist`` on the WORLD group when torch.distributed is initialised, else ``local``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _torch_dist(None)
    return LOCAL


def for_group(group: Any, what: str = "group") -> Backend:
    """The backend of a torch.distributed ``group`` (``None``: ``default_backend()``).

    Raises:
        TypeError: ``group`` is neither ``None`` nor a ``ProcessGroup`` (``what`` names the argument).
    """
    if group is None:
        return default_backend()
    import torch.distributed as dist

    outside = isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER  # new_group() off its ranks
    if not (outside or isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{what} group= takes a torch.distributed ProcessGroup or None, got {type(group).__name__}.")
    return _torch_dist(group)


_WORLD: list[Any] = []  # the backend of the default group, made once per default group: it holds no other state


def _torch_dist(group: Any) -> Backend:
    """The backend of ``group``; of the default group, one object while that group lives.

    One object lets a tree of arrays made with the default backend skip an equality test
    (and a hash) per leaf: ``a.backend is b.backend`` holds. A new default group (after
    ``destroy_process_group``) gets a new one, unequal to the old.
    """
    import torch.distributed as dist

    from fshard.backends.torch_dist import TorchDistBackend  # deferred: torch.distributed, loaded once a group is used

    if group is not None:
        return TorchDistBackend(group)
    world = dist.GroupMember.WORLD
    if not _WORLD or world is None or _WORLD[0].world is not world:  # None: no group (TorchDistBackend says so)
        _WORLD[:] = [TorchDistBackend(None)]
    return _WORLD[0]
