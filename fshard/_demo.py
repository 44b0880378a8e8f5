"""``python -m fshard demo``: shard, reshard, map and gather a real tensor, verify, report."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

import fshard
from fshard.testing.launch import launch

SHAPE = (96, 64)


def specs(world: int) -> dict[str, Any]:
    """The demo's layouts for ``world`` ranks: chunks, a mesh grid, uneven boxes, replicas."""
    ranks = list(range(world))
    a = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
    mesh = fshard.Mesh((a, world // a))
    return {
        "chunk rows": fshard.Chunk(0, ranks),
        "chunk cols": fshard.Chunk(-1, ranks),
        "mesh grid": fshard.Named(mesh, ("x", "y")),
        "uneven boxes": fshard.Explicit(_uneven(SHAPE, ranks)),
        "rows + replicas": fshard.Named(mesh, ("x", None)),
        "replicated": fshard.Replicated(ranks),
    }


def _uneven(shape: tuple[int, int], ranks: list[int]) -> list[fshard.ShardMeta]:
    """Two row bands split into columns of growing width (1 : 2 : 3 ...)."""
    top, bottom = ranks[: (len(ranks) + 1) // 2], ranks[(len(ranks) + 1) // 2 :]
    cut = shape[0] * 3 // 8 if bottom else shape[0]
    out: list[fshard.ShardMeta] = []
    for r0, r1, band in ((0, cut, top), (cut, shape[0], bottom)):
        weights = list(range(1, len(band) + 1))
        edges = [0] + [shape[1] * sum(weights[: k + 1]) // sum(weights) for k in range(len(band))]
        out += [fshard.ShardMeta((r0, c0), (r1 - r0, c1 - c0), r) for r, c0, c1 in zip(band, edges, edges[1:])]
    return out


def run(world: int, backend: Any = None) -> dict[str, Any]:
    """Runs every reshard between the demo layouts; returns rows and verification results."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    layouts = {name: s.layout(SHAPE) for name, s in specs(world).items()}
    rows: list[tuple[str, str, int, int, float, bool]] = []
    ok = True
    for src_name, src in layouts.items():
        a = fshard.shard(x, src, backend=backend)
        for dst_name, dst in layouts.items():
            if dst_name == src_name:
                continue
            counters = a.backend.counters
            before = counters.elements_sent
            start = time.perf_counter()
            b = fshard.reshard(a, dst)
            seconds = time.perf_counter() - start
            sent = a.backend.exchange(counters.elements_sent - before)
            same = bool(torch.equal(fshard.gather(b), x))
            ok &= same
            p = fshard.plan(src, dst)
            rows.append((src_name, dst_name, sum(sent), p.min_elements_sent, seconds * 1e3, same))
    y = fshard.map_local(_affine, fshard.shard(x, layouts["mesh grid"], backend=backend))
    mapped = bool(torch.equal(fshard.gather(y), x * 2 + 1))
    return {"rows": rows, "ok": ok and mapped, "mapped": mapped}


def _affine(t: torch.Tensor) -> torch.Tensor:
    return t * 2 + 1


def report(title: str, result: dict[str, Any], world: int, color: bool | str = False) -> str:
    """The layout pictures and the reshard table as text (``color``: see ``Layout.visualize``)."""
    lines = [f"== {title} =="]
    for name, s in specs(world).items():
        lines += [f"-- {name}", s.layout(SHAPE).visualize(width=48, color=color)]
    lines.append(f"{'source':<16} {'target':<16} {'sent':>7} {'minimum':>7} {'ms':>8}  equal")
    for src, dst, sent, minimum, ms, same in result["rows"]:
        lines.append(f"{src:<16} {dst:<16} {sent:>7} {minimum:>7} {ms:>8.2f}  {'yes' if same else 'NO'}")
    lines.append(f"map_local(2x+1) then gather equals the unsharded result: {'yes' if result['mapped'] else 'NO'}")
    lines.append("all results bit-identical: " + ("yes" if result["ok"] else "NO"))
    return "\n".join(lines)


def _dist_job(world: int) -> dict[str, Any]:
    return run(world)


def main(argv: Sequence[str] | None = None, prog: str = "python -m fshard demo") -> int:
    """Entry point of ``fshard demo``; exits non-zero if any check fails."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--world", type=int, default=4, help="ranks (local backend and Gloo processes)")
    parser.add_argument("--local-only", action="store_true", help="skip the Gloo processes")
    parser.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the layout pictures per rank: on a terminal (auto, needs rich), always, never",
    )
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world must be at least 1, got {args.world}")
    color = {"auto": "auto", "always": True, "never": False}[args.color]
    local = run(args.world)
    print(report(f"local backend, {args.world} ranks in this process", local, args.world, color))
    ok = local["ok"]
    if not args.local_only:
        results = launch(_dist_job, args.world, args.world)
        print()
        title = f"torch_dist backend, {args.world} Gloo processes on 127.0.0.1"
        print(report(title, results[0], args.world, color))
        ok &= all(r["ok"] for r in results)
        ok &= [r[:4] for r in results[0]["rows"]] == [r[:4] for r in local["rows"]]
    print("\nverdict:", "OK" if ok else "FAILED")
    return 0 if ok else 1
