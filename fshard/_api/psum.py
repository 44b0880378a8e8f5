"""Reductions inside a ``shard_map`` body: ``psum`` and ``pmean`` over mesh axes, as in JAX.

The body's mesh is the mesh of its ``Named`` in_specs. Where no in_spec is ``Named``
(``Chunk``, ``Replicated``, ...), the body's placements, in the order of its first
argument's layout, form a 1-axis mesh whose axis is called ``"x"``, as ``Mesh((n,))``
names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.autograd.forward_ad as fwAD

from fshard._base.cache import cached
from fshard._base.compile import opaque
from fshard._base.function import apply
from fshard._errors import SpecError
from fshard._exec import body as _body
from fshard._layout.placement import Placement
from fshard._layout.specs import Mesh

__all__ = ["body_mesh", "groups_of", "pmean", "psum"]

Groups = tuple[tuple[int, ...], ...]


@opaque  # a reduction across bodies, run eagerly: a graph break inside a compiled body
def psum(x: torch.Tensor, axis: str | Sequence[str]) -> torch.Tensor:
    """The sum of ``x`` over the placements of a ``shard_map`` body that differ only along mesh axes ``axis``.

    Called inside the function given to ``fshard.shard_map``, on every placement alike
    (JAX's ``jax.lax.psum``). Each placement gets the sum of the ``x`` of every placement
    that shares its coordinates on the mesh's other axes, so the result is the same
    along ``axis``. Differentiable: the gradient of each placement's ``x`` is the sum of
    the result's gradients over ``axis``, and in forward mode (``torch.autograd.forward_ad``)
    the result's tangent is the sum of the tangents. On ``torch_dist`` it is one all-reduce on the
    processes of ``axis``; on the local backend the bodies of a call that reduces run in
    threads, one each, taking turns, and sum in placement order (the same bits each run).

    Args:
        x: a tensor of the body, of the same shape and dtype on every placement.
        axis: a mesh axis name, or a tuple of them, of the body's mesh (the mesh of its
            ``Named`` in_specs; a 1-axis mesh with axis ``"x"`` for ``Chunk`` or
            ``Replicated`` in_specs).

    Returns:
        The sum, a new tensor on ``x``'s device.

    Raises:
        SpecError: outside a ``shard_map`` body, for an axis the body's mesh does not
            have, under a ``torch.func`` transform, or (from its backward) where the body
            itself differentiates through it (``torch.autograd.grad`` inside fn).
        TypeError: ``x`` is not a strided tensor (sparse, quantized or nested ones are refused).
        CollectiveMismatchError: the placements' bodies reduce differently (local backend), or
            ``x`` records a gradient (or has a forward-mode tangent) on only some of the
            placements summed together.

    >>> import torch, fshard
    >>> mesh = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
    >>> f = fshard.shard_map(
    ...     lambda b: fshard.psum(b, "tp"),
    ...     in_specs=fshard.Named(mesh, ("dp", "tp")),
    ...     out_specs=fshard.Named(mesh, ("dp", None)),
    ...     check_vma=False,  # the result is equal along tp: psum made it so
    ... )
    >>> fshard.gather(f(torch.arange(8.0).reshape(2, 4))).tolist()
    [[2.0, 4.0], [10.0, 12.0]]
    """
    body, axes = _enter("psum", x, axis)
    groups, of = groups_of(body.mesh, body.placements, axes)
    if all(len(g) == 1 for g in groups):
        return x
    body.summed.add(tuple(sorted(axes)))
    # The placements summed together must agree on these: the backward (and tangent) is a sum they all join.
    flags = (torch.is_grad_enabled() and x.requires_grad, fwAD.unpack_dual(x).tangent is not None)  # pyright: ignore[reportUnknownMemberType]
    if body.backend.spans_processes:
        if _shared_rank(body.placements):
            msg = "psum() on torch_dist needs one placement per process; the body's placements share a rank."
            raise SpecError(msg)
        partition = tuple(tuple(body.placements[j].rank for j in g) for g in groups)
        ranks = partition[of[body.index]]
        return cast(torch.Tensor, apply(_body.AllReduce, body.backend, partition, ranks, flags, x))
    if body.rendezvous is None:
        raise _body.NeedsThreads
    return body.rendezvous.reduce(
        body.index,
        axes,
        x,
        groups,
        lambda ts: apply(_body.GroupSum, groups, *ts),  # pyright: ignore[reportUnknownLambdaType, reportUnknownArgumentType]
        flags,
    )


@opaque  # as psum
def pmean(x: torch.Tensor, axis: str | Sequence[str]) -> torch.Tensor:
    """The mean of ``x`` over mesh axes ``axis``: ``psum(x, axis)`` over the number of placements summed.

    Args:
        x: a tensor of the body, of the same shape and dtype on every placement.
        axis: a mesh axis name, or a tuple of them (as for ``psum``).

    Raises:
        SpecError: as ``psum``.

    >>> import torch, fshard
    >>> ranks = [0, 1]
    >>> f = fshard.shard_map(
    ...     lambda b: fshard.pmean(b, "x"), in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks)
    ... )
    >>> fshard.gather(f(torch.tensor([1.0, 3.0]))).tolist()
    [2.0, 2.0]
    """
    body, axes = _enter("pmean", x, axis)
    groups, of = groups_of(body.mesh, body.placements, axes)
    return psum(x, axes) / len(groups[of[body.index]])


def body_mesh(specs: Sequence[Any], placements: Sequence[Placement]) -> Mesh:
    """The mesh that names a body's axes: its ``Named`` in_specs' one mesh, else ``placements`` on one axis ``"x"``.

    Raises:
        SpecError: the ``Named`` in_specs lie on different meshes.
    """
    meshes: list[Mesh] = []
    for s in specs:
        inner = getattr(s, "spec", s)  # a Partial's spec
        mesh = getattr(inner, "mesh", None)
        if isinstance(mesh, Mesh) and mesh not in meshes:
            meshes.append(mesh)
    if len(meshes) > 1:
        msg = f"shard_map() in_specs lie on different meshes ({meshes[0]!r} and {meshes[1]!r}): give them one mesh."
        raise SpecError(msg)
    return meshes[0] if meshes else _flat_mesh(tuple(placements))


@cached(256)
def _flat_mesh(placements: tuple[Placement, ...]) -> Mesh:
    return Mesh((len(placements),), ranks=list(placements))


def _enter(what: str, x: Any, axis: Any) -> tuple[_body.Body, tuple[str, ...]]:
    """The running body and ``axis`` as a tuple of names, checked."""
    body = _body.current()
    if body is None and torch._C._current_graph_task_id() != -1:  # pyright: ignore[reportPrivateUsage]  # in a backward
        msg = (
            f"{what}() ran in a backward, where no shard_map body runs: torch.utils.checkpoint recomputes a "
            "checkpointed function there, after its body has returned. Checkpoint the whole shard_map call "
            "instead (torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=False) with f the shard_map), "
            f"or keep the {what}() outside the checkpointed function."
        )
        raise SpecError(msg)
    if body is None:
        msg = (
            f"{what}() was called outside a shard_map body: it reduces over the placements of a body. "
            f"Call it inside the function given to fshard.shard_map(fn, in_specs, out_specs); outside one, "
            "reduce a Partial array with fshard.reshard(x, spec)."
        )
        raise SpecError(msg)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}() takes a tensor, got {type(x).__name__}.")
    if x.layout != torch.strided or x.is_quantized or x.is_nested:
        kind = "quantized" if x.is_quantized else "nested" if x.is_nested else str(x.layout)
        msg = f"{what}() takes a strided tensor, got a {kind} one: reduce x.to_dense() (or x.dequantize())."
        raise TypeError(msg)
    mesh = body.mesh
    if isinstance(axis, str):
        axes: tuple[Any, ...] = (axis,)
    elif isinstance(axis, (tuple, list)):
        axes = tuple(cast("Sequence[Any]", axis))
    else:
        axes = ()
    bad = [a for a in axes if not isinstance(a, str) or a not in mesh.axis_names]
    if not axes or bad or len(set(axes)) != len(axes):
        msg = (
            f"{what}() axis {axis!r}: the body's mesh has axes {mesh.axis_names} (shape {mesh.shape}); "
            "give one of them or a tuple of distinct ones"
            + ("" if len(mesh.axis_names) > 1 else " (a body without Named in_specs has the one axis 'x')")
            + "."
        )
        raise SpecError(msg)
    if _body.in_transform():
        msg = (
            f"{what}() cannot run under a torch.func transform (grad, vmap, jvp); differentiate with "
            "loss.backward() or torch.autograd.grad instead."
        )
        raise SpecError(msg)
    return body, axes


@cached(256)
def groups_of(mesh: Mesh, placements: tuple[Placement, ...], axes: tuple[str, ...]) -> tuple[Groups, tuple[int, ...]]:
    """The groups of body indices that differ only along ``axes`` (each in placement order), and each index's group.

    Raises:
        SpecError: the body's placements are not the mesh's.
    """
    where = {p: i for i, p in enumerate(mesh.ranks)}
    if len(placements) != len(where) or any(p not in where for p in placements):
        msg = (
            f"psum(): the body runs on placements {[str(p) for p in placements]} but its mesh holds "
            f"{[str(p) for p in mesh.ranks]}: lay every argument out over the mesh."
        )
        raise SpecError(msg)
    coords = np.array(np.unravel_index([where[p] for p in placements], mesh.shape)).T.reshape(len(placements), -1)
    other = [d for d, name in enumerate(mesh.axis_names) if name not in axes]
    of = np.zeros(len(placements), dtype=np.int64)
    if other:
        of = np.unique(coords[:, other], axis=0, return_inverse=True)[1].reshape(-1)
    groups: list[list[int]] = [[] for _ in range(int(of.max()) + 1 if len(of) else 0)]
    for i, g in enumerate(of.tolist()):
        groups[g].append(i)
    return tuple(tuple(g) for g in groups), tuple(int(g) for g in of.tolist())


@cached(256)
def _shared_rank(placements: tuple[Placement, ...]) -> bool:
    return len({p.rank for p in placements}) != len(placements)
