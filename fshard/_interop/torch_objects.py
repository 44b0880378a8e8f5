"""Conversions to and from torch's ``ShardedTensor`` and ``DTensor`` (they need torch.distributed).

Both directions share the shard tensors (no copy): an in-place change to the
torch object's local shards is visible through the ``ShardedArray``. torch is
imported inside the functions, so importing fshard never pulls in process-group code.
"""

from __future__ import annotations

import atexit
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fshard._api.move import from_local_shards_and_layout, reshard
from fshard._array.array import Shard, ShardedArray
from fshard._base.alloc import contiguous_strides
from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._exec.collective import collective
from fshard._interop.pending import PARTIAL, dtensor_placement, pending_of, summand_key, with_pending
from fshard._interop.strided import strided_layout
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.placement import Placement
from fshard._layout.specs import Mesh, Named
from fshard._layout.torch_meta import is_dtensor, is_sharded_tensor
from fshard.backends import Backend, for_group

__all__ = [
    "from_dtensor",
    "from_sharded_tensor",
    "from_torch_value",
    "already_sharded",
    "shard_already_sharded",
    "to_dtensor",
    "to_sharded_tensor",
]


def _check_array(array: Any, what: str) -> None:
    if not isinstance(array, ShardedArray):
        raise TypeError(f"{what} takes a ShardedArray, got {type(array).__name__}.")


def _dist_backend(array: ShardedArray, what: str) -> Any:
    backend = array.backend
    if getattr(backend, "rank", None) is None or not hasattr(backend, "group"):
        msg = (
            f"{what} needs an array on the torch_dist backend (torch's type lives in a process group), "
            f"got one on {backend.name!r}: initialise torch.distributed and build the array there."
        )
        raise SpecError(msg)
    return backend


def _torch_dist_backend(group: Any) -> Backend:
    return for_group(group)


def _boxes(layout: Layout) -> np.ndarray:
    """The layout as sorted rows (rank, offsets, sizes): what DTensor can tell apart.

    An empty box's offsets hold no element, and where they lie differs by convention (``Chunk``
    puts 5 columns over 4 ranks' last, empty box at column 6, DTensor's ``Shard`` at 5): they
    count as zeros.
    """
    lo, sz, rank = layout.columns.lo, layout.columns.sz, layout.columns.rank
    rows = np.c_[rank, np.where((sz == 0).any(axis=1, keepdims=True), 0, lo), sz]
    return rows[np.lexsort(rows.T[::-1])]


# -- ShardedTensor --------------------------------------------------------------------------


@collective("to_sharded_tensor")
def to_sharded_tensor(array: ShardedArray) -> Any:
    """The array as torch's ``ShardedTensor``, sharing its shard tensors (collective-free).

    Its metadata is ``array.layout.to_torch_metadata(...)``, its process group the
    array's. ShardedTensor cannot hold replicas: reshard to a layout without
    replicated boxes first. It also checks empty boxes against the shape, so an
    empty box past the end (``Chunk`` of 2 rows over 4 ranks puts one at row 3,
    as ``ChunkShardingSpec`` does) moves to the end of the dim it is empty in.

    Raises:
        TypeError: ``array`` is not a ``ShardedArray``.
        SpecError: the array is not on the torch_dist backend, its layout has replicas,
            or it holds a pending reduction (``fshard.Partial``).

    >>> import torch, torch.distributed as dist, fshard
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> x = fshard.shard(torch.arange(6.0).reshape(2, 3), fshard.Chunk(1, [0, 0]))
    >>> st = fshard.to_sharded_tensor(x)
    >>> [s.tensor.tolist() for s in st.local_shards()]
    [[[0.0, 1.0], [3.0, 4.0]], [[2.0], [5.0]]]
    >>> fshard.gather(fshard.from_sharded_tensor(st)).equal(fshard.gather(x))
    True
    >>> dist.destroy_process_group()
    """
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.shard import Shard as TorchShard

    _check_array(array, "to_sharded_tensor()")
    _check_not_partial(array, "to_sharded_tensor()", "which a ShardedTensor cannot hold")
    backend = _dist_backend(array, "to_sharded_tensor()")
    layout = array.layout
    boxes = [(s.offsets, s.sizes) for s in layout.shards if s.numel]
    if len(set(boxes)) != len(boxes):
        msg = (
            f"ShardedTensor cannot hold replicas, and {layout!r} repeats a box on several ranks: "
            "reshard to a layout where each box has one owner (fshard.reshard(x, fshard.Chunk(...))) first."
        )
        raise SpecError(msg)
    meta = _in_bounds(layout).to_torch_metadata(array.dtype, array.requires_grad)
    mine = backend.addressable(layout)
    local = [TorchShard(t.contiguous(), meta.shards_metadata[i]) for i, t in zip(mine, array.addressable_data)]
    # torch's one constructor from global metadata; its stubs leave process_group untyped
    return ShardedTensor._init_from_local_shards_and_global_metadata(  # pyright: ignore[reportPrivateUsage, reportUnknownMemberType]
        local, meta, process_group=backend.group
    )


def _check_not_partial(array: ShardedArray, what: str, why: str) -> None:
    if array.layout.partial is not None:
        msg = (
            f"{what} got an array with a pending {array.layout.partial} (fshard.Partial), {why}: reshard it to a "
            "non-partial spec first, e.g. fshard.reshard(x, fshard.Chunk(0, ranks))."
        )
        raise SpecError(msg)


def _in_bounds(layout: Layout) -> Layout:
    """``layout`` with each empty box at the end of its empty dims and inside the shape in the others."""
    if all(s.numel for s in layout.shards):
        return layout
    shards = [s if s.numel else _moved(s, layout.shape) for s in layout.shards]
    return Layout(layout.shape, shards)


def _moved(s: ShardMeta, shape: tuple[int, ...]) -> ShardMeta:
    offsets = tuple(n if z == 0 else min(o, n - z) for o, z, n in zip(s.offsets, s.sizes, shape))
    return ShardMeta(offsets, s.sizes, s.placement)


@collective("from_sharded_tensor")
def from_sharded_tensor(st: Any) -> ShardedArray:
    """A ``ShardedArray`` with the ShardedTensor's layout, local shards and process group.

    Raises:
        TypeError: ``st`` is not a ``ShardedTensor``.
        LayoutError: the metadata names RPC workers instead of ranks.

    >>> import torch, torch.distributed as dist, fshard
    >>> from torch.distributed._shard import sharded_tensor
    >>> from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> st = sharded_tensor.ones(ChunkShardingSpec(0, ["rank:0/cpu"]), 4, 2)
    >>> x = fshard.from_sharded_tensor(st)
    >>> x.layout == fshard.Chunk(0, [0]).layout((4, 2)), float(fshard.gather(x).sum())
    (True, 8.0)
    >>> dist.destroy_process_group()
    """
    if is_dtensor(st):
        msg = "from_sharded_tensor() takes a torch ShardedTensor, got a DTensor: use fshard.from_dtensor(dt)."
        raise TypeError(msg)
    if not is_sharded_tensor(st):
        msg = (
            f"from_sharded_tensor() takes a torch ShardedTensor, got {type(st).__name__}. For a state dict that "
            "mixes ShardedTensors and tensors, fshard.shard_params(state_dict) converts each ShardedTensor and "
            "keeps the rest."
        )
        raise TypeError(msg)
    layout = Layout.from_torch_metadata(st.metadata())
    shards = [Shard(_shard_meta(s.metadata), s.tensor) for s in st.local_shards()]
    return from_local_shards_and_layout(shards, layout, backend=_torch_dist_backend(st._process_group))


def already_sharded(value: Any) -> tuple[str, str, str] | None:
    """A torch value whose data already lives on its ranks: its kind, where, and its conversion; else ``None``.

    >>> import torch
    >>> already_sharded(torch.ones(2)) is None
    True
    """
    if is_sharded_tensor(value):
        return "ShardedTensor", "its process group's ranks", "fshard.from_sharded_tensor(st)"
    if is_dtensor(value):
        return "DTensor", "its mesh's ranks", "fshard.from_dtensor(dt)"
    return None


def shard_already_sharded(value: Any, spec: Any, *, src: int | None = None, backend: Any = None) -> ShardedArray:
    """``fshard.shard`` of a ``ShardedTensor`` or ``DTensor``: it is already sharded, so converted, then resharded.

    Raises:
        SpecError: ``src`` or ``backend`` is given: the value's data already lives on its
            ranks; the message gives the conversion to use.
    """
    found = already_sharded(value)
    if found is None:
        raise TypeError(f"shard_already_sharded() takes a ShardedTensor or a DTensor, got {type(value).__name__}.")
    kind, where, convert = found
    if src is not None or backend is not None:
        given = "src=" if src is not None else "backend="
        msg = (
            f"shard() got a torch {kind} together with {given}: its data already lives on {where}. Convert it "
            f"instead: fshard.reshard({convert}, spec)."
        )
        raise SpecError(msg)
    return reshard(from_sharded_tensor(value) if kind == "ShardedTensor" else from_dtensor(value), spec)


def from_torch_value(value: Any) -> Any:
    """A ``ShardedTensor`` as a ``ShardedArray`` (``from_sharded_tensor``); anything else as it is."""
    return from_sharded_tensor(value) if is_sharded_tensor(value) else value


def _shard_meta(meta: Any) -> ShardMeta:
    return ShardMeta(tuple(meta.shard_offsets), tuple(meta.shard_sizes), Placement.parse(str(meta.placement)))


# -- DTensor --------------------------------------------------------------------------------


def _fshard_mesh(device_mesh: Any, devices: Sequence[str] | None = None) -> Mesh:
    """The DeviceMesh as an fshard ``Mesh`` (same shape, ranks and axis names)."""
    ranks = device_mesh.mesh.flatten().tolist()
    places = tuple(Placement(r, d) for r, d in zip(ranks, devices or ["cpu"] * len(ranks)))
    names = device_mesh.mesh_dim_names
    return Mesh(tuple(device_mesh.mesh.shape), ranks=places, axis_names=tuple(names) if names else None)


def _check_mesh(mesh: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, (Mesh, DeviceMesh)):
        raise SpecError(f"to_dtensor() needs an fshard.Mesh or a torch DeviceMesh, got {type(mesh).__name__}.")


def _device_mesh(mesh: Any, array: ShardedArray) -> tuple[Any, Mesh]:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        return mesh, _fshard_mesh(mesh)
    import torch.distributed as dist

    world = dist.group.WORLD
    key = (mesh, array.device.type)
    cached = _DEVICE_MESHES.get(key)
    if cached is None or cached[0] is not world:  # a new process group needs new sub-groups
        assert mesh.ranks is not None
        ranks = torch.tensor([p.rank for p in mesh.ranks]).reshape(mesh.shape)
        cached = _DEVICE_MESHES[key] = (world, DeviceMesh(array.device.type, ranks, mesh_dim_names=mesh.axis_names))
    return cached[1], mesh


# Building a DeviceMesh creates process groups (collectively): one per mesh and device type is enough.
_DEVICE_MESHES: dict[tuple[Mesh, str], tuple[Any, Any]] = {}
# Let go of them (and of the default group) at exit, as fshard's backends do: a group still held at the
# interpreter's teardown can abort the process there (fshard.backends.torch_dist._let_go_of_groups).
atexit.register(_DEVICE_MESHES.clear)


def _partition(mesh: Mesh, choice: Sequence[int | str | None], ndim: int) -> tuple[Any, ...]:
    """Per tensor dim, the mesh axes (in mesh order) that shard it: DTensor's placements as a partition."""
    assert mesh.axis_names is not None
    out: list[Any] = []
    for d in range(ndim):
        axes = tuple(name for name, c in zip(mesh.axis_names, choice) if c == d)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


@cached(256)
def _placements_for(layout: Layout, mesh: Mesh) -> tuple[Any, ...]:
    """The Shard/Replicate/Partial placements whose layout on ``mesh`` is ``layout``; raises if none is.

    A pending reduction's summands lie along the ``Partial`` dims, its replicas along the
    ``Replicate`` ones (``fshard._interop.pending``).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    want, key = _boxes(layout), summand_key(layout)
    options: list[int | str | None] = [None, *range(layout.ndim)] + ([PARTIAL] if layout.partial else [])
    for choice in itertools.product(options, repeat=len(mesh.shape)):
        over = tuple(a for a, c in zip(mesh.axis_names, choice) if c == PARTIAL)
        pending = (str(layout.partial), over) if over else None
        spec = with_pending(Named(mesh, _partition(mesh, choice, layout.ndim)), pending)
        candidate = spec.layout(layout.shape)
        if np.array_equal(_boxes(candidate), want) and summand_key(candidate) == key:
            return tuple(
                Replicate() if c is None else dtensor_placement(str(layout.partial)) if c == PARTIAL else DShard(c)
                for c in choice
            )
    msg = (
        f"DTensor cannot express {layout!r} with Shard, Replicate and Partial placements (to_dtensor makes no "
        f"_StridedShard ones) on a mesh of shape {mesh.shape} over ranks "
        f"{[p.rank for p in mesh.ranks or ()]}: a DTensor holds one box per mesh position, splitting each dim by "
        "torch.chunk over whole mesh axes (Shard) or not at all (Replicate), with the summands of a pending "
        "reduction along whole mesh axes (Partial), and these boxes are not of that form. "
        "Reshard first: fshard.reshard(x, fshard.Named(mesh, partition))."
    )
    raise SpecError(msg)


@collective("to_dtensor")
def to_dtensor(array: ShardedArray, mesh: Any) -> Any:
    """The array as a ``DTensor`` on ``mesh`` (an ``fshard.Mesh`` or a torch ``DeviceMesh``), sharing shards.

    The layout must be what some ``Shard``/``Replicate`` placements give on the
    mesh (that is, ``fshard.Named(mesh, partition)`` for some partition), or for a
    pending reduction ``Shard``/``Replicate``/``Partial`` placements
    (``fshard.Partial(Named(mesh, partition), op, over=axes)``, the ``Partial`` dims
    being ``axes``); those placements are found and used (``Replicate()`` where a mesh
    axis of size 1 makes ``Shard`` and ``Replicate`` the same). The first call with an
    ``fshard.Mesh`` builds its ``DeviceMesh``, which is collective (torch
    creates sub-groups); later calls reuse it.

    Raises:
        TypeError: ``array`` is not a ``ShardedArray``.
        SpecError: ``mesh`` is neither an ``fshard.Mesh`` nor a ``DeviceMesh``, the array is
            not on the torch_dist backend, or DTensor cannot express its layout on the mesh
            (arbitrary boxes, several boxes per rank, summands that are not along whole mesh axes).

    >>> import torch, torch.distributed as dist, fshard
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> mesh = fshard.Mesh((1,))
    >>> x = fshard.shard(torch.arange(4.0), fshard.Named(mesh, ("x",)))
    >>> dt = fshard.to_dtensor(x, mesh)  # on one rank, Shard(0) is the same layout as Replicate()
    >>> dt.placements, dt.full_tensor().tolist()
    ((Replicate(),), [0.0, 1.0, 2.0, 3.0])
    >>> dist.destroy_process_group()
    """
    _check_array(array, "to_dtensor()")
    _check_mesh(mesh)
    backend = _dist_backend(array, "to_dtensor()")
    from torch.distributed.tensor import DTensor

    device_mesh, fmesh = _device_mesh(mesh, array)
    placements = _placements_for(array.layout, fmesh)
    mine = backend.addressable(array.layout)
    local = array.addressable_data[0] if mine else torch.empty(0, dtype=array.dtype, device=array.device)
    return DTensor.from_local(
        local,
        device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(array.shape),
        stride=contiguous_strides(array.shape),
    )


def _check_placements(dt: Any) -> None:
    for i, p in enumerate(dt.placements):
        if p.is_partial():  # a pending reduction (``fshard._interop.pending``)
            continue
        if not (p.is_replicate() or type(p).__name__ in ("Shard", "_StridedShard")):
            msg = (
                f"DTensor placement {p!r} on mesh dim {i} is not Shard(dim), _StridedShard(dim) or Replicate(): "
                "redistribute to Shard/Replicate placements first."
            )
            raise SpecError(msg)


@collective("from_dtensor")
def from_dtensor(dt: Any) -> ShardedArray:
    """A ``ShardedArray`` laid out as the DTensor (``fshard.Named`` on its mesh), sharing its local tensor.

    ``_StridedShard`` placements (FSDP2's ``fully_shard`` over a tensor-parallel module) are
    read as DTensor lays them out: each rank's local tensor may hold several boxes of the
    global tensor (uneven sizes), which become that rank's shards of an explicit layout, each
    a view of the local tensor. ``Partial`` placements (of a sum, max or min) become a pending
    reduction over their mesh dims: ``fshard.Partial(Named(mesh, partition), op, over=axes)``,
    replicated along the ``Replicate()`` dims.

    Raises:
        TypeError: ``dt`` is not a ``DTensor``.
        SpecError: a ``Partial`` of another op (the message gives the ``redistribute``
            call that fixes it) or another placement than ``Shard``/``Replicate``/``Partial``;
            or this rank is not in the DTensor's mesh (call it on the mesh's ranks only).

    >>> import torch, torch.distributed as dist, fshard
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Shard, distribute_tensor
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> dt = distribute_tensor(torch.arange(6.0).reshape(3, 2), init_device_mesh("cpu", (1,)), [Shard(1)])
    >>> x = fshard.from_dtensor(dt)
    >>> x.layout == fshard.Named(fshard.Mesh((1,)), (None, "x")).layout((3, 2)), fshard.gather(x).tolist()
    (True, [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    >>> dist.destroy_process_group()
    """
    if not is_dtensor(dt):
        msg = (
            f"from_dtensor() takes a torch DTensor, got {type(dt).__name__}: shard a tensor with "
            "fshard.shard(t, spec), or make a DTensor first (DTensor.from_local)."
        )
        raise TypeError(msg)
    _check_placements(dt)
    device_mesh = dt.device_mesh
    backend = _torch_dist_backend(_mesh_group(device_mesh))
    local = dt.to_local()
    devices = None
    if device_mesh.device_type != "cpu":  # each rank's device index is its own: ask
        seen = dict(backend.exchange((backend.rank, str(local.device))))
        devices = [seen[r] for r in device_mesh.mesh.flatten().tolist()]
    mesh = _fshard_mesh(device_mesh, devices)
    pending = pending_of(dt.placements, mesh)
    if any(type(p).__name__ == "_StridedShard" for p in dt.placements):
        if pending is not None:
            fixed = ["Replicate()" if q.is_partial() else repr(q) for q in dt.placements]
            msg = (
                f"from_dtensor() reads _StridedShard placements or Partial ones, not both, got {dt.placements}: "
                f"reduce first with dt.redistribute(dt.device_mesh, [{', '.join(fixed)}])."
            )
            raise SpecError(msg)
        return _from_strided(dt, mesh, local, backend)
    choice = [p.dim if p.is_shard() else None for p in dt.placements]
    spec = with_pending(Named(mesh, _partition(mesh, choice, dt.ndim)), pending)
    layout = spec.layout(tuple(dt.shape))
    shards = [Shard(layout.shards[i], local) for i in backend.addressable(layout)]
    return from_local_shards_and_layout(shards, layout, backend=backend)


def _from_strided(dt: Any, mesh: Mesh, local: torch.Tensor, backend: Backend) -> ShardedArray:
    """``from_dtensor`` with ``_StridedShard`` placements: a rank's local tensor may be several boxes, each a view."""
    layout, at = strided_layout(tuple(dt.shape), mesh, [_split_of(p) for p in dt.placements])
    mine = backend.addressable(layout)
    shards = [Shard(layout.shards[i], local[_view(at[i], layout.shards[i].sizes)]) for i in mine]
    return from_local_shards_and_layout(shards, layout, backend=backend)


def _split_of(p: Any) -> tuple[str, int, int]:
    if p.is_replicate():
        return ("replicate", -1, 1)
    if type(p).__name__ == "_StridedShard":
        return ("strided", p.dim, int(p.split_factor))
    return ("shard", p.dim, 1)


def _view(offsets: Any, sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(int(o), int(o) + n) for o, n in zip(offsets, sizes))


def _mesh_group(device_mesh: Any) -> Any:
    """A process group of exactly the mesh's ranks: WORLD, or the group of a 1-D mesh."""
    import torch.distributed as dist

    ranks = sorted(device_mesh.mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        return None
    if dist.get_rank() not in ranks:
        msg = (
            f"from_dtensor() on rank {dist.get_rank()}, which is not in the DTensor's mesh (ranks {ranks}): "
            "call it on the mesh's ranks only (where dt.device_mesh.get_coordinate() is not None)."
        )
        raise SpecError(msg)
    if device_mesh.ndim == 1:
        return device_mesh.get_group()
    msg = (
        f"from_dtensor() supports a multi-dimensional mesh only over every rank of the world, got ranks {ranks}: "
        "use a 1-D mesh over the subset, or a mesh over all ranks."
    )
    raise SpecError(msg)
