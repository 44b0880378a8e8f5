"""fshard in one page: shard a tensor, reshard it, work on the shards, gather it back.

Runs as it is on one process (the local backend holds every rank):

    python examples/quickstart.py

and unchanged on 4 processes, one rank each (the torch_dist backend):

    torchrun --nproc-per-node 4 examples/quickstart.py

Every rank runs the same lines with the same arguments (SPMD); only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fshard

WORLD = 4


def start() -> tuple[int, int]:
    """Joins the process group when launched by torchrun; returns (rank, world size)."""
    if "RANK" not in os.environ or dist.is_initialized():
        return 0, WORLD
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size()


def main() -> dict[str, object]:
    rank, world = start()
    say = print if rank == 0 else (lambda *a, **k: None)
    ranks = list(range(world))
    x = torch.arange(96.0).reshape(8, 12)

    # 1. Shard rows over every rank: each rank keeps its own block, nothing is sent.
    rows = fshard.shard(x, fshard.Chunk(0, ranks))
    say(rows)
    say(rows.layout.visualize(width=36, color="auto"))  # colours per rank on a terminal with rich

    # 2. Reshard to columns: only the elements whose owner changes move.
    cols = fshard.reshard(rows, fshard.Chunk(1, ranks))
    p = fshard.plan(rows.layout, cols.layout)
    say(f"rows -> columns: {p.elements_sent} elements sent (minimum {p.min_elements_sent})")

    # 3. Work on the local shards, then gather the global result on every rank.
    y = fshard.map_local(lambda t: t * 2 + 1, cols)
    full = fshard.gather(y)
    ok = torch.equal(full, x * 2 + 1)
    say("gather(map_local(2x + 1)) equals 2x + 1:", ok)

    # 4. Layout-invariant random numbers: the same values whatever the layout.
    a = fshard.rand(fshard.Chunk(0, ranks), 8, 12, seed=0)
    b = fshard.rand(fshard.Replicated(ranks[:1]), 8, 12, seed=0)
    same = fshard.equal(a, b)
    say("rand is layout-invariant:", same)
    if dist.is_initialized():
        dist.barrier()  # every rank done with the last collective before any tears the group down
        dist.destroy_process_group()
    return {"rank": rank, "world": world, "ok": ok and same, "sent": p.elements_sent}


if __name__ == "__main__":
    # No options: --help says what the script does, anything else is an error, not a traceback.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    result = main()
    if not result["ok"]:
        raise SystemExit(1)
