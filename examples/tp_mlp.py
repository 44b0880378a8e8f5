"""A tensor-parallel MLP training step, checked against the unsharded model.

The model is ``Linear(d_in, hidden) -> GELU -> Linear(hidden, d_out)`` split the way
Megatron-LM splits a transformer's MLP block:

- the first layer is **column-parallel**: its weight (hidden x d_in) and bias are split
  by output feature, so each rank computes its slice of the hidden activations from
  the whole input with ``map_local``; nothing moves;
- the second layer is **row-parallel**: its weight (d_out x hidden) is split by input
  feature, so each rank turns its hidden slice into a partial output. The partials are
  summed by a ``reshard`` that hands each rank the partials of its batch rows (a
  reduce-scatter) and a local sum;
- the second bias is replicated. It is broadcast in its replicated layout and moved to
  the batch rows by a ``reshard``: nothing is sent forward, and the backward of that
  reshard brings every rank's rows of the gradient to every copy, which sums them.

``torch.func.grad_and_value`` differentiates the loss with respect to the dict of
sharded parameters, and an SGD step updates them with ``map_local``. The script
checks the loss, every gradient shard (replicas included) and the loss after the step
against the unsharded ``torch.nn`` model, in float64.

    python examples/tp_mlp.py                          # local backend: 1, 2 and 4 ranks in this process
    python examples/tp_mlp.py --ranks 3                # local backend, 3 ranks
    python examples/tp_mlp.py --world 4                # 4 Gloo processes on this machine
    torchrun --nproc-per-node 2 examples/tp_mlp.py     # 2 processes started by torchrun (Gloo)

It exits with status 1 if a check fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import fshard

SIZES = {"batch": 6, "d_in": 5, "hidden": 10, "d_out": 3}  # uneven on 4 ranks: 3, 3, 3, 1 hidden; 2, 2, 2, 0 rows
LR = 0.1
RTOL, ATOL = 1e-9, 1e-12  # float64; sums run in another order than in the unsharded model


def model(seed: int = 0) -> torch.nn.Sequential:
    """The unsharded reference model, in float64, with weights drawn from ``seed``."""
    net = torch.nn.Sequential(
        torch.nn.Linear(SIZES["d_in"], SIZES["hidden"]),
        torch.nn.GELU(),
        torch.nn.Linear(SIZES["hidden"], SIZES["d_out"]),
    ).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return net


def batch(step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of training step ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(SIZES["batch"], SIZES["d_in"], generator=g, dtype=torch.float64)
    return x, torch.randn(SIZES["batch"], SIZES["d_out"], generator=g, dtype=torch.float64)


def specs(ranks: Sequence[int]) -> dict[str, Any]:
    """Column-parallel first layer, row-parallel second layer, replicated second bias."""
    ranks = list(ranks)
    return {
        "0.weight": fshard.Chunk(0, ranks),
        "0.bias": fshard.Chunk(0, ranks),
        "2.weight": fshard.Chunk(1, ranks),
        "2.bias": fshard.Replicated(ranks),
    }


def shard_model(net: torch.nn.Module, ranks: Sequence[int], backend: Any = None) -> dict[str, fshard.ShardedArray]:
    """The model's parameters as sharded arrays laid out by ``specs(ranks)``."""
    spec = specs(ranks)
    return fshard.shard_params(net, lambda name, t: spec[name], backend=backend)


# -- layouts of the intermediate values, derived from the parameters' layouts -------------------


def columns_like(layout: fshard.Layout, rows: int) -> fshard.Layout:
    """A ``(rows, n)`` layout whose shard k holds the columns that shard k of ``layout`` holds along dim 0."""
    shards = tuple(fshard.ShardMeta((0, m.offsets[0]), (rows, m.sizes[0]), m.placement) for m in layout.shards)
    return fshard.Layout((rows, layout.shape[0]), shards)


def one_per_shard(layout: fshard.Layout, shape: tuple[int, ...]) -> fshard.Layout:
    """A ``(k, *shape)`` layout: entry k (one partial result) on the placement of shard k of ``layout``."""
    zero = (0,) * len(shape)
    shards = tuple(fshard.ShardMeta((k, *zero), (1, *shape), m.placement) for k, m in enumerate(layout.shards))
    return fshard.Layout((len(shards), *shape), shards)


def broadcast_like(layout: fshard.Layout, shape: tuple[int, ...]) -> fshard.Layout:
    """The whole of ``shape`` on the placement of every shard of the replicated ``layout``."""
    zero = (0,) * len(shape)
    return fshard.Layout(shape, tuple(fshard.ShardMeta(zero, shape, m.placement) for m in layout.shards))


def zip_shards(
    fn: Callable[..., torch.Tensor], out: fshard.Layout, *arrays: fshard.ShardedArray
) -> fshard.ShardedArray:
    """``fn`` on the k-th shards of arrays whose shard k sit on one rank; the results laid out by ``out``.

    ``map_local`` pairs the shards of arrays that share a layout. Here the operands
    have different shapes but shards that line up, so the results are wrapped with
    ``from_local_shards_and_layout``, which takes the tensors as they are: gradients
    flow through it unchanged.
    """
    first = arrays[0]
    owners = [m.placement for m in first.layout.shards]
    if any([m.placement for m in a.layout.shards] != owners for a in arrays[1:]):
        raise ValueError("zip_shards() needs arrays whose k-th shards sit on one placement, for every k.")
    index = first.backend.addressable(first.layout)
    results = [fn(*ts) for ts in zip(*(a.addressable_data for a in arrays))]
    shards = [fshard.Shard(out.shards[k], t) for k, t in zip(index, results)]
    return fshard.from_local_shards_and_layout(shards, out, backend=first.backend)


# -- the model -------------------------------------------------------------------------------------


def column_parallel(x: torch.Tensor, w: fshard.ShardedArray, b: fshard.ShardedArray) -> fshard.ShardedArray:
    """``gelu(x @ w.T + b)`` with ``w`` split by rows: the result is split by columns alike."""
    n = x.shape[0]
    cols = columns_like(w.layout, n)
    xw = fshard.map_local(lambda t: x @ t.T, w, out_spec=cols)
    bias = fshard.map_local(lambda t: t.expand(n, -1), b, out_spec=cols)
    return fshard.map_local(lambda u, v: F.gelu(u + v), xw, bias)


def row_parallel(h: fshard.ShardedArray, w: fshard.ShardedArray, b: fshard.ShardedArray) -> fshard.ShardedArray:
    """``h @ w.T + b`` with ``h`` split by columns and ``w`` by columns alike; the result is split by rows.

    Returns a ``(1, n, d_out)`` array whose batch rows are split over the ranks.
    """
    n, d_out = h.shape[0], w.shape[0]
    partial = zip_shards(lambda u, v: (u @ v.T).unsqueeze(0), one_per_shard(h.layout, (n, d_out)), h, w)
    by_rows = fshard.Chunk(1, [m.placement for m in h.layout.shards])
    summed = fshard.map_local(lambda t: t.sum(0, keepdim=True), fshard.reshard(partial, by_rows))
    bias = fshard.map_local(lambda t: t.expand(1, n, -1), b, out_spec=broadcast_like(b.layout, (1, n, d_out)))
    return fshard.map_local(torch.add, summed, fshard.reshard(bias, summed.layout))


def loss_fn(params: dict[str, fshard.ShardedArray], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the tensor-parallel MLP: the same value on every rank."""
    h = column_parallel(x, params["0.weight"], params["0.bias"])
    out = row_parallel(h, params["2.weight"], params["2.bias"])
    return F.mse_loss(fshard.gather(out)[0], y)


def sgd(params: dict[str, fshard.ShardedArray], grads: dict[str, fshard.ShardedArray]) -> dict[str, Any]:
    """One SGD step: new arrays, shard by shard (the gradients share the parameters' layouts)."""
    return {k: fshard.map_local(lambda p, g: p - LR * g, params[k], grads[k]) for k in params}


# -- the check --------------------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def check(ranks: Sequence[int], backend: Any = None) -> dict[str, Any]:
    """One training step on ``ranks`` against the unsharded model; what this process saw.

    Every rank of ``backend``'s group (default: the default backend) calls it alike.
    """
    net = model()
    params = shard_model(net, ranks, backend)
    x, y = batch(0)
    grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)

    reference = F.mse_loss(net(x), y)
    reference.backward()
    want = dict(net.named_parameters())
    bad = [
        f"{name} shard {s.meta.offsets}"
        for name, g in grads.items()
        for s in g.addressable_shards
        if not _close(s.data, want[name].grad[tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))])
    ]

    x1, y1 = batch(1)
    with torch.no_grad():
        for p in net.parameters():
            p -= LR * p.grad
        after_reference = F.mse_loss(net(x1), y1)
    after = loss_fn(sgd(params, grads), x1, y1)
    return {
        "ranks": len(list(ranks)),
        "loss": float(loss),
        "reference": float(reference.detach()),
        "next_loss": float(after),
        "next_reference": float(after_reference),
        "bad_gradients": bad,
        "ok": _close(loss, reference) and _close(after, after_reference) and not bad,
    }


def report(result: dict[str, Any]) -> str:
    """One line per check."""
    verdict = "ok" if result["ok"] else f"MISMATCH {result['bad_gradients']}"
    return (
        f"{result['ranks']} ranks: loss {result['loss']:.12f} (unsharded {result['reference']:.12f}), "
        f"after one SGD step {result['next_loss']:.12f} (unsharded {result['next_reference']:.12f}): {verdict}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check on the local backend, on spawned Gloo processes (``--world N``), or under torchrun."""
    from fshard._launch import check_main

    return check_main(check, report, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
