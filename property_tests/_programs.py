"""Small programs over sharded values, written as plain data, and their interpreter.

A program is ``(inputs, ops)``: ``inputs`` are ``(shape, seed)`` pairs of float64
tensors (present on every rank, leaves of autograd), and each op is a tuple
``(name, *args)`` whose arguments are indices into the environment (the inputs,
then each op's result in order), specs, layouts, ranks and names of functions from
the tables below. Programs pickle, so a test draws one in its own process and the
workers of the Gloo pool run the very same records.

``run(program)`` interprets a program on the default backend (local in a process
without a process group, torch_dist in a pool worker) and returns what must agree
between backends: the layouts and gathered values of every result, the gradients
of a loss of those values with respect to the program's leaves, and the first error
(the op that raised and the exception type).

Leaves are the inputs (present on every rank: each rank's gradient is the whole
one), the tensors of ``shard_src`` ops (present on the source rank only) and those
that ``partial`` ops take summands from (each rank's gradient is that of its own
summands, so the ranks' gradients add up to the whole one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import fshard
from fshard import Chunk, Mesh, Named, Partial, Replicated
from fshard._api import move as _move
from fshard._exec import collective as _collective
from fshard.backends.local import LocalBackend

__all__ = ["FNS", "MATMULS", "SHAPE_FNS", "Env", "data", "run"]

FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sin": torch.sin,
    "square": lambda t: t * t,
    "affine": lambda t: 2 * t + 1,
    "scale": lambda t: 3 * t,
}
BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "mul": torch.mul,
    "sub_sq": lambda a, b: a - b * b,
}
SHAPE_FNS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "cat": lambda t, d: torch.cat([t, 2 * t], d),
    "sum_keep": lambda t, d: t.sum(d, keepdim=True),
    "head": lambda t, d: t.narrow(d, 0, min(1, t.shape[d])),
}
CLOSURES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "scalar": lambda blk, g: blk * g.sum(),
    "row": lambda blk, g: blk + g,
}


def _mesh(ranks: tuple[int, ...]) -> Mesh:
    return Mesh((2, 2), ranks=list(ranks))


# Per kind of shard_map matmul: (in_specs, out_specs) for ranks R (or a 2x2 mesh of them).
MATMULS: dict[str, Callable[[tuple[int, ...]], tuple[tuple[Any, Any], Any]]] = {
    "inner": lambda r: ((Chunk(1, list(r)), Chunk(0, list(r))), Partial(Replicated(list(r)))),
    "rows": lambda r: ((Chunk(0, list(r)), Replicated(list(r))), Chunk(0, list(r))),
    "cols": lambda r: ((Replicated(list(r)), Chunk(1, list(r))), Chunk(1, list(r))),
    "grid": lambda r: (
        (Named(_mesh(r), ("x", "y")), Named(_mesh(r), ("y", None))),
        Partial(Named(_mesh(r), ("x", None))),
    ),
    "grid_rows": lambda r: ((Named(_mesh(r), ("x", None)), Replicated(list(r))), Named(_mesh(r), ("x", None))),
}
# shard_map out_specs that claim replicas: along y where the argument's copies are (accepted), and along
# x where the argument is split (refused: the copies would disagree).
CLAIMS: dict[str, Callable[[tuple[int, ...]], tuple[Any, Any]]] = {
    "implied": lambda r: (Named(_mesh(r), ("x", None)), Named(_mesh(r), ("x", None))),
    "contradicted": lambda r: (Named(_mesh(r), ("x", "y")), Named(_mesh(r), (None, "y"))),
}
BIASES: dict[str, Callable[[tuple[int, ...]], tuple[tuple[Any, Any], Any]]] = {
    "rows": lambda r: ((Chunk(0, list(r)), Replicated(list(r))), Chunk(0, list(r))),
    "grid": lambda r: ((Named(_mesh(r), ("x", None)), Replicated(list(r))), Named(_mesh(r), ("x", None))),
}


def data(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The float64 values of an input (the same on every rank and in every process)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _summand(t: torch.Tensor, meta: fshard.ShardMeta, i: int, op: str) -> torch.Tensor:
    box = t[tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))]
    return box * (i + 1) if op == "sum" else box + 0.5 * i


class Env:
    """The values of a program so far; ``apply(op)`` appends the result of one op."""

    def __init__(self, inputs: tuple[tuple[tuple[int, ...], int], ...]) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else None
        self.leaves = [data(shape, seed).requires_grad_() for shape, seed in inputs]
        self.values: list[Any] = list(self.leaves)
        self.sources: list[torch.Tensor | None] = []  # the leaves of shard_src ops (None off src)
        self.summands: list[torch.Tensor] = []  # the leaves of partial ops

    def apply(self, op: tuple[Any, ...]) -> None:
        self.values.append(getattr(self, "_" + op[0])(*op[1:]))

    def _shard(self, t: int, spec: Any) -> fshard.ShardedArray:
        return fshard.shard(self.values[t], spec)

    def _shard_src(self, shape: tuple[int, ...], seed: int, spec: Any, src: int) -> fshard.ShardedArray:
        leaf = data(shape, seed).requires_grad_() if self.rank in (None, src) else None
        self.sources.append(leaf)
        return fshard.shard(leaf, spec, src=src)

    def _reshard(self, v: int, spec: Any) -> fshard.ShardedArray:
        return fshard.reshard(self.values[v], spec)

    def _gather(self, v: int) -> torch.Tensor:
        return fshard.gather(self.values[v])

    def _map(self, v: int, fn: str, linear: bool) -> fshard.ShardedArray:
        return fshard.map_local(FNS[fn], self.values[v], linear=linear)

    def _map2(self, v: int, w: int, fn: str, out_spec: Any) -> fshard.ShardedArray:
        return fshard.map_local(BINARY[fn], self.values[v], self.values[w], out_spec=out_spec)

    def _map_shape(self, v: int, fn: str, dim: int) -> fshard.ShardedArray:
        return fshard.map_local(lambda t: SHAPE_FNS[fn](t, dim), self.values[v])

    def _closure(self, v: int, g: int, fn: str) -> fshard.ShardedArray:
        """``fn`` of each block of ``v`` and the gathered value of array ``g`` (captured, not an argument)."""
        captured = fshard.gather(self.values[g])
        return fshard.map_local(lambda t: CLOSURES[fn](t, captured), self.values[v])

    def _closed(self, v: int, t: int, fn: str) -> fshard.ShardedArray:
        """``fn`` of each block of ``v`` and the plain tensor ``t``, closed over (not an argument)."""
        captured = self.values[t]
        return fshard.map_local(lambda blk: CLOSURES[fn](blk, captured), self.values[v])

    def _claim(self, v: int, ranks: tuple[int, ...], claim: str) -> fshard.ShardedArray:
        """``shard_map`` of ``2 * t`` whose ``out_specs`` claims replicas (``CLAIMS``): refused where they differ."""
        in_spec, out_spec = CLAIMS[claim](ranks)
        return fshard.shard_map(lambda t: 2 * t, in_specs=in_spec, out_specs=out_spec)(self.values[v])

    def _matmul(self, x: int, w: int, kind: str, ranks: tuple[int, ...]) -> fshard.ShardedArray:
        in_specs, out_specs = MATMULS[kind](ranks)
        return fshard.shard_map(torch.matmul, in_specs, out_specs)(self.values[x], self.values[w])

    def _bias(self, x: int, b: int, kind: str, ranks: tuple[int, ...]) -> fshard.ShardedArray:
        in_specs, out_specs = BIASES[kind](ranks)
        return fshard.shard_map(torch.add, in_specs, out_specs)(self.values[x], self.values[b])

    def _partial(self, shape: tuple[int, ...], seed: int, spec: Partial, grad: bool) -> fshard.ShardedArray:
        """Per-rank summands (max/min operands) from a leaf of this op: shard ``i`` holds the leaf's
        box scaled by ``i + 1`` (shifted by ``i / 2`` for max and min). Each rank passes its own
        shards, so on torch_dist each rank's leaf gets the gradient of its own summands only."""
        leaf = data(shape, seed).requires_grad_(grad)
        self.summands.append(leaf)
        layout = spec.layout(shape)
        mine = range(len(layout.shards)) if self.rank is None else layout.indices_on(self.rank)
        shards = [fshard.Shard(layout.shards[i], _summand(leaf, layout.shards[i], i, spec.op)) for i in mine]
        return fshard.from_local_shards_and_layout(shards, layout)

    def _binop(self, v: int, w: Any, fn: str) -> fshard.ShardedArray:
        other = self.values[w] if isinstance(w, int) else w[0]
        return _BINOPS[fn](self.values[v], other)

    def _rbinop(self, v: int, scalar: float, fn: str) -> fshard.ShardedArray:
        return _BINOPS[fn](scalar, self.values[v])

    def _neg(self, v: int) -> fshard.ShardedArray:
        return -self.values[v]

    def _sum(self, v: int, dim: int | None) -> fshard.ShardedArray:
        return self.values[v].sum() if dim is None else self.values[v].sum(dim)


_BINOPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "**": lambda a, b: a**b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
}


def _weights(shape: tuple[int, ...], k: int) -> torch.Tensor:
    return data(shape, 10_000 + k)


@contextlib.contextmanager
def _four_ranks() -> Iterator[None]:
    """Outside torch.distributed, the default backend is a local world of the pool's 4 ranks.

    ``LocalBackend(world_size=4)`` checks ranks (and ranks without blocks) as the 4 Gloo
    processes do, so both sides refuse the same programs.
    """
    if dist.is_initialized():
        yield
        return
    four = LocalBackend(world_size=4)
    saved = (_move.default_backend, _collective.default_backend)
    _move.default_backend = _collective.default_backend = lambda: four
    try:
        yield
    finally:
        _move.default_backend, _collective.default_backend = saved


def run(program: tuple[Any, Any]) -> dict[str, Any]:
    """Runs ``program`` on the default backend; see the module docstring for the result."""
    with _four_ranks():
        return _run(program)


def _run(program: tuple[Any, Any]) -> dict[str, Any]:
    inputs, ops = program
    env = Env(inputs)
    out: dict[str, Any] = {"error": None, "layouts": [], "values": [], "grads": None}
    for n, op in enumerate(ops):
        try:
            env.apply(op)
        except Exception as e:
            out["error"] = (n, type(e).__name__, str(e)[:400])
            return out
    try:
        results = [fshard.gather(v) if isinstance(v, fshard.ShardedArray) else v for v in env.values]
    except Exception as e:
        out["error"] = ("gather", type(e).__name__, str(e)[:400])
        return out
    out["layouts"] = [v.layout if isinstance(v, fshard.ShardedArray) else None for v in env.values]
    out["values"] = [r.detach().clone() for r in results]
    # The loss reads every result (not the inputs themselves), each with its own weights.
    terms = [
        (r * _weights(tuple(r.shape), k)).sum() for k, r in enumerate(results) if k >= len(inputs) and r.requires_grad
    ]
    sources = [s for s in env.sources if s is not None]
    leaves = env.leaves + sources + env.summands
    if not terms:
        return out
    try:
        # backward(), not autograd.grad(leaves): a rank without a leaf (off a shard_src's
        # source) still runs the backward collectives its shards' history leads to.
        torch.stack(terms).sum().backward()
    except Exception as e:
        out["error"] = ("grad", type(e).__name__, str(e)[:400])
        return out
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]
    n, m = len(env.leaves), len(env.leaves) + len(sources)
    src = iter(grads[n:m])
    out["grads"] = grads[:n]
    out["source_grads"] = [next(src) if s is not None else None for s in env.sources]
    out["summand_grads"] = grads[m:]
    return out
