"""A pre-norm transformer block trained with tensor and data parallelism, checked against ``torch.nn``.

The block is ``torch.nn.TransformerEncoderLayer(norm_first=True)``, without dropout:

    h   = x + out_proj(attention(qkv_proj(LayerNorm1(x))))
    out = h + linear2(gelu(linear1(LayerNorm2(h))))

The ranks form a 2-D mesh with axes ``("dp", "tp")``: the batch is split over ``dp``
(data parallel) and the weights over ``tp`` (tensor parallel, as in Megatron-LM), each
weight replicated over ``dp``. Every step of the forward pass is one ``fshard.shard_map``
(a function of per-rank blocks, with specs for its arguments and results):

- **heads, column-parallel**: the QKV projection is split by attention head (its weight
  is viewed as ``(3, heads, head_dim, d_model)``), so each rank computes LayerNorm1 and
  the attention of its heads for its sequences; nothing moves;
- **output projection, row-parallel**: its weight (viewed as ``(d_model, heads,
  head_dim)``) is split by head like the attention's output, so each rank's product is
  a summand of the output: a ``Partial`` array, pending a sum over ``tp``. A ``reshard``
  to the tokens' layout (batch over ``dp``, replicated over ``tp``) reduces it: a
  reduce-scatter then an all-gather within each ``dp`` group;
- the residual and the replicated bias are added per block; the MLP is split the same
  way (``linear1`` column-parallel, ``linear2`` row-parallel, reduced by a ``reshard``),
  as in ``tp_mlp.py``.

Each rank's copy of a weight sees only its ``dp`` group's sequences; the gradient of a
replicated value is the sum of its uses, so every copy's gradient is the sum over the
``dp`` groups, the gradient of the whole batch, with no gradient all-reduce written out.
``torch.optim.AdamW`` then updates the shard tensors (``optree.tree_leaves(params)``) in
place: every copy gets the same gradient and so stays equal to the others.

The script checks, in float64: every gradient shard of the first step (replicas
included) against the ``torch.nn`` model's gradient, and that on meshes with more than one
``dp`` group a copy's gradient is not that of its own group's sequences alone; the loss of
each AdamW step; and the parameters after the last step.

On ``n`` ranks the mesh is ``(n // 2, 2)`` for even ``n`` and ``(n, 1)`` for odd ``n``: 4
ranks make the 2 x 2 mesh, 2 ranks a ``(1, 2)`` mesh (tensor parallel only), 1 rank a
``(1, 1)`` mesh.

    python examples/transformer_block.py                          # local backend: 1, 2 and 4 ranks
    python examples/transformer_block.py --ranks 4                # local backend, the 2 x 2 mesh
    python examples/transformer_block.py --world 4                # 4 Gloo processes on this machine
    torchrun --nproc-per-node 4 examples/transformer_block.py     # 4 processes started by torchrun (Gloo)

It exits with status 1 if a check fails.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.nn.functional as F

import fshard

# Uneven on the 2 x 2 mesh: sequences split 2, 1 over dp; heads 2, 1 and MLP features 5, 4 over tp.
SIZES = {"batch": 3, "seq": 4, "d_model": 6, "heads": 3, "ffn": 9}
HEAD_DIM = SIZES["d_model"] // SIZES["heads"]
EPS = 1e-5  # LayerNorm
ADAMW = {"lr": 0.01, "weight_decay": 0.1}
STEPS = 3
RTOL, ATOL = 1e-9, 1e-12  # float64; sums run in another order than in the unsharded model
# The key bias's gradient is zero in exact arithmetic (a shift shared by every key leaves the
# softmax unchanged); AdamW divides its rounding noise (1e-17) by sqrt(v) + eps, which moves it by
# up to lr * 1e-8 per step, differently in each model. Parameters are compared to that.
PARAM_ATOL = 1e-9

# How each parameter is split: a view of the torch parameter (heads as a dim of their own)
# and a partition over the mesh axes per dim of that view. Unused axes replicate.
D, H = SIZES["d_model"], SIZES["heads"]
VIEWS = {
    "self_attn.in_proj_weight": (3, H, HEAD_DIM, D),  # q, k, v; head; head_dim; input feature
    "self_attn.in_proj_bias": (3, H, HEAD_DIM),
    "self_attn.out_proj.weight": (D, H, HEAD_DIM),  # output feature; head; head_dim
}
PARTITIONS: dict[str, tuple[str | None, ...]] = {
    "self_attn.in_proj_weight": (None, "tp", None, None),
    "self_attn.in_proj_bias": (None, "tp", None),
    "self_attn.out_proj.weight": (None, "tp", None),
    "self_attn.out_proj.bias": (None,),
    "linear1.weight": ("tp", None),
    "linear1.bias": ("tp",),
    "linear2.weight": (None, "tp"),
    "linear2.bias": (None,),
    "norm1.weight": (None,),
    "norm1.bias": (None,),
    "norm2.weight": (None,),
    "norm2.bias": (None,),
}
# The activations: tokens (batch, seq, d_model), heads (batch, head, seq, head_dim), MLP features (batch, seq, ffn).
TOKENS, HEADS, FEATURES = ("dp", None, None), ("dp", "tp", None, None), ("dp", None, "tp")


def mesh(ranks: Sequence[int]) -> fshard.Mesh:
    """The ``("dp", "tp")`` mesh of ``ranks``: ``(n // 2, 2)`` for an even count ``n``, else ``(n, 1)``."""
    ranks = list(ranks)
    tp = 2 if len(ranks) % 2 == 0 else 1
    return fshard.Mesh((len(ranks) // tp, tp), ranks=ranks, axis_names=("dp", "tp"))


def model(seed: int = 0) -> torch.nn.TransformerEncoderLayer:
    """The unsharded reference block, in float64, with weights drawn from ``seed``."""
    block = torch.nn.TransformerEncoderLayer(
        D, H, SIZES["ffn"], dropout=0.0, activation="gelu", layer_norm_eps=EPS, batch_first=True, norm_first=True
    ).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return block


def batch(step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of training step ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    shape = (SIZES["batch"], SIZES["seq"], D)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def shard_model(block: torch.nn.Module, ranks: Sequence[int], backend: Any = None) -> dict[str, fshard.ShardedArray]:
    """The block's parameters, in the views of ``VIEWS``, as arrays split by ``PARTITIONS`` over ``mesh(ranks)``."""
    m = mesh(ranks)
    return {
        name: fshard.shard(
            p.detach().reshape(VIEWS.get(name, p.shape)), fshard.Named(m, PARTITIONS[name]), backend=backend
        )
        for name, p in block.named_parameters()
    }


# -- the block -------------------------------------------------------------------------------------


def _heads(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """LayerNorm1, then the attention of the heads of ``w``: (batch, heads, seq, head_dim)."""
    a = F.layer_norm(x, (D,), g, b, EPS)
    q, k, v = torch.einsum("btd,shed->sbhte", a, w) + wb[:, None, :, None, :]
    scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
    return torch.softmax(scores, dim=-1) @ v


def _out_proj(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """This rank's heads' share of the output projection: (batch, seq, d_model)."""
    return torch.einsum("bhte,dhe->btd", o, w)


def _features(h: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """LayerNorm2, then this rank's features of ``gelu(linear1(.))``."""
    return F.gelu(F.layer_norm(h, (D,), g, b, EPS) @ w.T + wb)


def _add(x: torch.Tensor, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x + y + b


def _specs(m: fshard.Mesh, names: Sequence[str]) -> tuple[fshard.Named, ...]:
    return tuple(fshard.Named(m, PARTITIONS[name]) for name in names)


def residual(x: Any, y: fshard.ShardedArray, b: fshard.ShardedArray, m: fshard.Mesh) -> fshard.ShardedArray:
    """``x + y + b`` on tokens, ``b`` replicated: each copy of ``b`` is used on its ``dp`` group's tokens."""
    tokens = fshard.Named(m, TOKENS)
    return fshard.shard_map(_add, in_specs=(tokens, tokens, fshard.Named(m, (None,))), out_specs=tokens)(x, y, b)


def attention(p: dict[str, fshard.ShardedArray], x: torch.Tensor, m: fshard.Mesh) -> fshard.ShardedArray:
    """``x + out_proj(attention(LayerNorm1(x)))``: heads column-parallel, output projection row-parallel."""
    tokens = fshard.Named(m, TOKENS)
    names = ("norm1.weight", "norm1.bias", "self_attn.in_proj_weight", "self_attn.in_proj_bias")
    heads = fshard.shard_map(_heads, in_specs=(tokens, *_specs(m, names)), out_specs=fshard.Named(m, HEADS))
    out_proj = fshard.shard_map(
        _out_proj,
        in_specs=(fshard.Named(m, HEADS), *_specs(m, ["self_attn.out_proj.weight"])),
        out_specs=fshard.Partial(tokens),
    )
    summands = out_proj(heads(x, *(p[n] for n in names)), p["self_attn.out_proj.weight"])
    return residual(x, fshard.reshard(summands, tokens), p["self_attn.out_proj.bias"], m)


def mlp(p: dict[str, fshard.ShardedArray], h: fshard.ShardedArray, m: fshard.Mesh) -> fshard.ShardedArray:
    """``h + linear2(gelu(linear1(LayerNorm2(h))))``: ``linear1`` column-parallel, ``linear2`` row-parallel."""
    tokens, features = fshard.Named(m, TOKENS), fshard.Named(m, FEATURES)
    names = ("norm2.weight", "norm2.bias", "linear1.weight", "linear1.bias")
    linear1 = fshard.shard_map(_features, in_specs=(tokens, *_specs(m, names)), out_specs=features)
    linear2 = fshard.shard_map(
        lambda u, w: u @ w.T, in_specs=(features, *_specs(m, ["linear2.weight"])), out_specs=fshard.Partial(tokens)
    )
    summands = linear2(linear1(h, *(p[n] for n in names)), p["linear2.weight"])
    return residual(h, fshard.reshard(summands, tokens), p["linear2.bias"], m)


def forward(params: dict[str, fshard.ShardedArray], x: torch.Tensor, m: fshard.Mesh) -> fshard.ShardedArray:
    """The block on the mesh ``m``: (batch, seq, d_model), batch split over ``dp``, replicated over ``tp``."""
    return mlp(params, attention(params, x, m), m)


def loss_fn(params: dict[str, fshard.ShardedArray], x: torch.Tensor, y: torch.Tensor, m: fshard.Mesh) -> torch.Tensor:
    """Mean squared error of the block's output: the same value on every rank."""
    return F.mse_loss(fshard.gather(forward(params, x, m)), y)


# -- the check --------------------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return bool(torch.allclose(a, b, rtol=RTOL, atol=atol))


def _box(t: torch.Tensor, meta: fshard.ShardMeta) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))]


def _views(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: g.reshape(VIEWS.get(name, g.shape)) for name, g in grads.items()}


def reference_grads(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
    """The gradient of the batch's loss from the sequences ``rows`` alone, in the views of ``VIEWS``."""
    loss = F.mse_loss(block(x[rows]), y[rows], reduction="sum") / y.numel()
    return _views(dict(zip(dict(block.named_parameters()), torch.autograd.grad(loss, list(block.parameters())))))


def _dp_rows(m: fshard.Mesh) -> dict[int, slice]:
    """The sequences of each rank's ``dp`` group."""
    rows = fshard.Named(m, TOKENS).layout((SIZES["batch"], 1, 1))
    return {s.placement.rank: slice(s.offsets[0], s.offsets[0] + s.sizes[0]) for s in rows.shards}


def check_grads(
    grads: dict[str, fshard.ShardedArray], block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, m: fshard.Mesh
) -> dict[str, Any]:
    """Every gradient shard here against the unsharded gradient; and, with several ``dp`` groups, that a
    copy's gradient is not its own group's part of it (it is the sum over the groups)."""
    whole = reference_grads(block, x, y, slice(None))
    rows = _dp_rows(m) if m.shape[0] > 1 else {}
    parts = {(s.start, s.stop): reference_grads(block, x, y, s) for s in rows.values()}
    bad, summed = [], 0
    for name, g in grads.items():
        for s in g.addressable_shards:
            where = f"{name} shard {s.meta.offsets} on rank {s.meta.placement.rank}"
            if not _close(s.data, _box(whole[name], s.meta)):
                bad.append(where)
            group = rows.get(s.meta.placement.rank)
            if group is not None and s.data.numel():
                summed += 1
                if _close(s.data, _box(parts[group.start, group.stop][name], s.meta)):
                    bad.append(f"{where} (only its dp group's part)")
    return {"bad_gradients": bad, "dp_summed": summed}


def check(ranks: Sequence[int], backend: Any = None) -> dict[str, Any]:
    """``STEPS`` AdamW steps on ``ranks`` against the unsharded block; what this process saw.

    Every rank of ``backend``'s group (default: the default backend) calls it alike.
    """
    m = mesh(ranks)
    block = model()
    params = shard_model(block, ranks, backend)
    leaves = optree.tree_leaves(params)
    opt = torch.optim.AdamW(leaves, **ADAMW)
    reference_opt = torch.optim.AdamW(block.parameters(), **ADAMW)
    losses, references, grad_check = [], [], {}
    for step in range(STEPS):
        x, y = batch(step)
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y, m)
        if step == 0:
            grad_check = check_grads(grads, block, x, y, m)
        for t, g in zip(leaves, optree.tree_leaves(grads)):
            t.grad = g
        opt.step()

        reference_opt.zero_grad()
        reference = F.mse_loss(block(x), y)
        reference.backward()
        reference_opt.step()
        losses.append(float(loss))
        references.append(float(reference.detach()))

    want = _views({name: p.detach() for name, p in block.named_parameters()})
    bad_params = [
        f"{name} shard {s.meta.offsets}"
        for name, a in params.items()
        for s in a.addressable_shards
        if not _close(s.data, _box(want[name], s.meta), PARAM_ATOL)
    ]
    losses_ok = all(_close(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, references))
    return {
        "ranks": len(list(ranks)),
        "mesh": tuple(m.shape),
        "losses": losses,
        "references": references,
        **grad_check,
        "bad_params": bad_params,
        "ok": losses_ok and not grad_check["bad_gradients"] and not bad_params,
    }


def report(result: dict[str, Any]) -> str:
    """One line per check."""
    bad = result["bad_gradients"] + result["bad_params"]
    verdict = "ok" if result["ok"] else f"MISMATCH {bad}"
    losses = ", ".join(f"{a:.12f}" for a in result["losses"])
    references = ", ".join(f"{b:.12f}" for b in result["references"])
    dp = result["mesh"][0]
    summed = f"{result['dp_summed']} gradient shards hold the sum over {dp} dp groups" if dp > 1 else "one dp group"
    return (
        f"{result['ranks']} ranks, mesh {result['mesh']}: AdamW losses {losses} (unsharded {references}); "
        f"{summed}: {verdict}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check on the local backend, on spawned Gloo processes (``--world N``), or under torchrun."""
    from fshard.testing.launch import check_main

    return check_main(check, report, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
