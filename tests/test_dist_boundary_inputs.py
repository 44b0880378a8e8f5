"""``shard(x, spec, src=k)`` on 4 Gloo processes where rank k's ``x`` is a conjugate or
negative view, or a tensor that cannot be sharded: the values arrive on every rank, or
every rank raises the same typed error; nobody is left waiting."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard import Chunk, Replicated

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
Z = torch.arange(32.0).reshape(8, 4) + 1j * torch.arange(32.0, 64.0).reshape(8, 4)
VIEWS = {
    "conj": lambda: Z.conj(),
    "conj-imag": lambda: Z.conj().imag,
    "conj-columns": lambda: Z.conj()[:, 1:3],
    "neg-view": lambda: torch._neg_view(Z.real.contiguous()),  # contiguous, so sent in place
}


def _box(meta: fshard.ShardMeta) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))


def _view_from(view: str, src: int) -> list[bool]:
    x = VIEWS[view]() if dist.get_rank() == src else None
    want = VIEWS[view]().resolve_conj().resolve_neg()
    oks = []
    for spec in (Chunk(0, R), Chunk(1, R), Replicated(R)):
        a = fshard.shard(x, spec, src=src)
        oks.append(all(torch.equal(s.data, want[_box(s.meta)]) for s in a.addressable_shards))
        oks.append(torch.equal(fshard.gather(a), want))
    return oks


@pytest.mark.parametrize("src", [0, 2])
@pytest.mark.parametrize("view", VIEWS)
def test_a_conjugate_or_negative_view_from_src_arrives_whole(dist_pool, view: str, src: int) -> None:
    assert dist_pool.run(_view_from, view, src, timeout=60) == [[True] * 6] * 4


def _bad_from_rank_1(kind: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad = {
            "meta": lambda: torch.ones(8, 4, device="meta"),
            "quantized": lambda: torch.quantize_per_tensor(torch.ones(8, 4), 0.1, 0, torch.quint8),
        }[kind]()
    x = bad if dist.get_rank() == 1 else None
    try:
        fshard.shard(x, Chunk(0, R), src=1)
    except Exception as exc:
        out = (type(exc).__name__, str(exc))
    else:
        out = None
    # The group still works: nothing was left in flight.
    return out, torch.equal(fshard.gather(fshard.shard(Z if dist.get_rank() == 1 else None, Chunk(0, R), src=1)), Z)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("meta", "shard() input on rank 1 is on the meta device, which holds no values"),
        ("quantized", "shard() input on rank 1 has quantized dtype torch.quint8"),
    ],
    ids=["meta", "quantized"],
)
def test_a_tensor_that_cannot_be_sent_raises_on_every_rank(dist_pool, kind: str, message: str) -> None:
    got = dist_pool.run(_bad_from_rank_1, kind, timeout=60)
    assert [(g[0][0], g[1]) for g in got] == [("SpecError", True)] * 4
    assert len({g[0][1] for g in got}) == 1
    assert got[0][0][1].startswith(message)
