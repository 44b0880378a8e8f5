"""A tensor-parallel MLP training step, checked against the unsharded model.

The model is ``Linear(d_in, hidden) -> GELU -> Linear(hidden, d_out)`` split the way
Megatron-LM splits a transformer's MLP block. Each layer is one ``fshard.shard_map``:
a function of per-rank blocks, with the layouts of its arguments and results given as
specs, so no layout is built by hand:

- the first layer is **column-parallel**: its weight (hidden x d_in) and bias are split
  by output feature (``Chunk(0)``) and the input is replicated, so each rank computes
  its columns of the hidden activations (``Chunk(1)``) from the whole input; nothing
  moves;
- the second layer is **row-parallel**: its weight (d_out x hidden) is split by input
  feature (``Chunk(1)``), like the hidden activations' columns, so each rank's product
  is a full-shape summand of the output: a ``Partial(Replicated(ranks))`` array. A
  ``reshard`` to batch rows (``Chunk(0)``) reduces it with a reduce-scatter;
- the second bias is replicated and added to each rank's batch rows by a third
  ``shard_map``. Each copy is used on other rows, and its gradient is the sum of
  those uses: every copy holds the whole gradient. ``gather`` then gives every rank
  the output, and every rank computes the same loss.

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

from collections.abc import Sequence
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


# -- the model -------------------------------------------------------------------------------------


def placements(w: fshard.ShardedArray) -> list[fshard.Placement]:
    """The placements of a weight chunked over the ranks, in chunk order (devices included)."""
    return [m.placement for m in w.layout.shards]


def column_parallel(x: torch.Tensor, w: fshard.ShardedArray, b: fshard.ShardedArray) -> fshard.ShardedArray:
    """``gelu(x @ w.T + b)`` with ``w`` and ``b`` split by output feature: the result is split by columns alike.

    ``x`` is the same on every rank; ``shard_map`` lays it out replicated, which slices
    nothing and sends nothing.
    """
    ranks = placements(w)
    layer = fshard.shard_map(
        lambda xb, wb, bb: F.gelu(xb @ wb.T + bb),
        in_specs=(fshard.Replicated(ranks), fshard.Chunk(0, ranks), fshard.Chunk(0, ranks)),
        out_specs=fshard.Chunk(1, ranks),
    )
    return layer(x, w, b)


def row_parallel(h: fshard.ShardedArray, w: fshard.ShardedArray, b: fshard.ShardedArray) -> fshard.ShardedArray:
    """``h @ w.T + b`` with ``h`` split by columns and ``w`` by columns alike; the result is split by batch rows.

    Each rank's product is a full-shape summand of the output, a ``Partial`` array; the
    ``reshard`` to batch rows reduces it (a reduce-scatter), and the replicated bias is
    added to each rank's rows.
    """
    ranks = placements(w)
    partial = fshard.shard_map(
        lambda hb, wb: hb @ wb.T,
        in_specs=(fshard.Chunk(1, ranks), fshard.Chunk(1, ranks)),
        out_specs=fshard.Partial(fshard.Replicated(ranks)),
    )(h, w)
    rows = fshard.reshard(partial, fshard.Chunk(0, ranks))
    add_bias = fshard.shard_map(
        torch.add,
        in_specs=(fshard.Chunk(0, ranks), fshard.Replicated(ranks)),
        out_specs=fshard.Chunk(0, ranks),
    )
    return add_bias(rows, b)


def loss_fn(params: dict[str, fshard.ShardedArray], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the tensor-parallel MLP: the same value on every rank."""
    h = column_parallel(x, params["0.weight"], params["0.bias"])
    out = row_parallel(h, params["2.weight"], params["2.bias"])
    return F.mse_loss(fshard.gather(out), y)


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
    from fshard.testing.launch import check_main

    return check_main(check, report, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
