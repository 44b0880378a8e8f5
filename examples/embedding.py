"""A sharded embedding lookup, two ways, checked against ``torch.nn.functional.embedding``.

- **vocab-parallel** (Megatron-LM's ``VocabParallelEmbedding``; ShardedTensor's
  row-wise sharding): the table (vocab x dim) is split by rows. Each rank looks up
  the ids that fall in its rows and writes zeros for the others; the partial results
  are summed by a ``reshard`` that hands each rank the partials of its tokens (a
  reduce-scatter) and a local sum. The result is split by tokens.
- **dim-parallel** (ShardedTensor's column-wise sharding; DTensor's ``Shard(1)``): the
  table is split by columns. Each rank looks up every id in its columns with
  ``map_local``; nothing moves, and the result is split by columns like the table.

For both, the script checks the looked-up vectors and the gradient of the table
(``torch.func.grad`` of a weighted sum, with repeated ids) against the unsharded
lookup; both are bit-identical, since every output element is the same product
and every gradient row the same sum as in the unsharded lookup.

    python examples/embedding.py                          # local backend: 1, 2 and 4 ranks in this process
    python examples/embedding.py --world 4                # 4 Gloo processes on this machine
    torchrun --nproc-per-node 4 examples/embedding.py     # 4 processes started by torchrun (Gloo)

It exits with status 1 if a check fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import fshard

VOCAB, DIM = 11, 6
IDS = torch.tensor([[3, 0, 10, 3], [7, 7, 1, 9]])  # repeated ids: their gradients add up


def table() -> torch.Tensor:
    """The embedding table, the same on every rank."""
    return torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def weights() -> torch.Tensor:
    """Weights of the loss ``(lookup * weights).sum()``, one per output element."""
    return torch.randn(*IDS.shape, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def vocab_parallel(emb: fshard.ShardedArray, ids: torch.Tensor) -> fshard.ShardedArray:
    """Rows of ``emb`` (split by vocabulary rows) for ``ids``; a ``(1, n_ids, dim)`` array split by ids.

    Each table shard yields one partial result, entry k of a ``(shards, n_ids, dim)``
    array on that shard's rank: its rows for the ids in its range, zeros elsewhere.
    """
    flat = ids.reshape(-1)
    n, dim = flat.numel(), emb.shape[1]
    zero = (0, 0)
    out = fshard.Layout(
        (len(emb.layout.shards), n, dim),
        tuple(fshard.ShardMeta((k, *zero), (1, n, dim), m.placement) for k, m in enumerate(emb.layout.shards)),
    )
    parts = []
    for k, s in zip(emb.backend.addressable(emb.layout), emb.addressable_shards):
        lo, rows = s.meta.offsets[0], s.meta.sizes[0]
        mine = (flat >= lo) & (flat < lo + rows)
        # Ids outside this shard read an extra zero row, so that every shard (an empty one too)
        # yields a partial that depends on its data.
        padded = F.pad(s.data, (0, 0, 0, 1))
        partial = F.embedding(torch.where(mine, flat - lo, rows), padded)
        parts.append(fshard.Shard(out.shards[k], partial.unsqueeze(0)))
    partials = fshard.from_local_shards_and_layout(parts, out, backend=emb.backend)
    by_ids = fshard.Chunk(1, [m.placement for m in emb.layout.shards])
    return fshard.map_local(lambda t: t.sum(0, keepdim=True), fshard.reshard(partials, by_ids))


def dim_parallel(emb: fshard.ShardedArray, ids: torch.Tensor) -> fshard.ShardedArray:
    """Rows of ``emb`` (split by columns) for ``ids``; an ``(*ids.shape, dim)`` array split by columns alike."""
    lead = (0,) * ids.ndim
    out = fshard.Layout(
        (*ids.shape, emb.shape[1]),
        tuple(
            fshard.ShardMeta((*lead, m.offsets[1]), (*ids.shape, m.sizes[1]), m.placement) for m in emb.layout.shards
        ),
    )
    return fshard.map_local(lambda t: F.embedding(ids, t), emb, out_spec=out)


def _lookups(ranks: list[int]) -> dict[str, tuple[Any, Any]]:
    """Per method: the table's spec and a function from the sharded table to the full lookup."""
    return {
        "vocab-parallel": (
            fshard.Chunk(0, ranks),
            lambda e: fshard.gather(vocab_parallel(e, IDS))[0].view(*IDS.shape, -1),
        ),
        "dim-parallel": (fshard.Chunk(1, ranks), lambda e: fshard.gather(dim_parallel(e, IDS))),
    }


def check(ranks: Sequence[int], backend: Any = None) -> dict[str, Any]:
    """Both lookups on ``ranks`` against the unsharded one; what this process saw.

    Every rank of ``backend``'s group (default: the default backend) calls it alike.
    """
    ranks = list(ranks)
    full, w = table(), weights()
    want = F.embedding(IDS, full)
    want_grad = torch.func.grad(lambda t: (F.embedding(IDS, t) * w).sum())(full)
    results = {}
    for name, (spec, lookup) in _lookups(ranks).items():
        emb = fshard.shard(full, spec, backend=backend)
        got = lookup(emb)
        grad = torch.func.grad(lambda e, lookup=lookup: (lookup(e) * w).sum())(emb)
        same_grad = all(
            torch.equal(s.data, want_grad[tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))])
            for s in grad.addressable_shards
        )
        results[name] = {"values": bool(torch.equal(got, want)), "gradient": same_grad}
    ok = all(all(r.values()) for r in results.values())
    return {"ranks": len(ranks), "methods": results, "ok": ok}


def report(result: dict[str, Any]) -> str:
    """One line per check."""
    word = {True: "equal", False: "DIFFERENT"}
    parts = [
        f"{name}: values {word[r['values']]}, table gradient {word[r['gradient']]}"
        for name, r in result["methods"].items()
    ]
    return f"{result['ranks']} ranks: " + "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check on the local backend, on spawned Gloo processes (``--world N``), or under torchrun."""
    from fshard.testing.launch import check_main

    return check_main(check, report, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
