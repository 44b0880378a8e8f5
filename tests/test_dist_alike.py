"""shard_map results laid out from every rank's blocks (``Chunk`` out_specs), on 4 Gloo processes.

Every rank must learn the other ranks' block shapes. Where every rank's results are alike
(one structure and dtype, the same block shapes at each position), one ``all_reduce`` of
three numbers says so, whatever the number of ranks, and nothing more is exchanged; where
they differ, the ranks exchange their descriptions, and the results or errors are those of
the local backend. ``equal`` and ``allclose`` agree on their answer the same way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _counting import calls

import fshard
from fshard import SpecError
from fshard._api.map_out import laid_out

R = [0, 1, 2, 3]


def _results(kind: str) -> tuple[Any, ...]:
    """One shard_map whose results' extent comes from the blocks; its global shape, values and collectives."""
    mesh = fshard.Mesh((2, 2), R)
    # Named: rows split over x, copies along y (ranks 0, 1 alike, and 2, 3).
    spec = fshard.Named(mesh, ("x",)) if kind == "named" else fshard.Chunk(0, R)
    rows = 6 if kind == "ragged" else 16  # 6 rows: blocks of 2, 2, 2 and 0 rows
    x = fshard.shard(torch.arange(rows * 4.0).reshape(rows, 4), spec)

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return t * 2, {"sum": t.sum(1)}

    step = fshard.shard_map(fn, in_specs=spec, out_specs=spec)
    with calls() as counts:
        y, aux = step(x)
    hits = laid_out.cache_info().hits
    again, _ = step(x)
    made_once = again.layout is y.layout and laid_out.cache_info().hits >= hits + 2  # both results' layouts
    return y.shape, fshard.gather(y).tolist(), fshard.gather(aux["sum"]).tolist(), counts, made_once


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["even", "ragged", "named"])
def test_results_alike_on_every_rank_need_one_all_reduce_and_no_exchange(dist_pool, kind):
    shape, values, sums, _, same = _results(kind)
    for got in dist_pool.run(_results, kind, timeout=60):
        assert got[:3] == (shape, values, sums)  # the local backend's
        # Alike: one all_reduce of the digests. Ragged blocks: that, then the exchange of the shapes.
        assert got[3] == {"all_reduce": 1, "all_to_all_single": 1 if kind == "ragged" else 0}
        assert got[4]  # the second call's layout is the first's: made once
    assert same
    assert shape == ((6, 4) if kind == "ragged" else (16, 4))


def _differs(kind: str) -> tuple[str, str, list[str]]:
    """A shard_map with Chunk out_specs whose fn differs on the block of rows 8-11 (rank 2's)."""
    x = fshard.shard(torch.arange(32.0).reshape(16, 2), fshard.Chunk(0, R))

    def fn(t: torch.Tensor) -> Any:
        if t[0, 0] != 16:
            return t + 1
        if kind == "raises":
            raise ValueError("fn refused this block")
        return t.double() if kind == "dtype" else t[:1] if kind == "shape" else (t, t)

    try:
        fshard.shard_map(fn, in_specs=fshard.Chunk(0, R), out_specs=fshard.Chunk(0, R))(x)
    except (ValueError, SpecError) as exc:
        return type(exc).__name__, str(exc), getattr(exc, "__notes__", [])
    return "no error", "", []


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("kind", "error", "says"),
    [
        ("raises", "ValueError", "fn refused this block"),
        ("dtype", "SpecError", "dtypes"),
        ("structure", "SpecError", "returned"),
        ("shape", "SpecError", "on placement rank:2/cpu has shape (1, 2) but out_spec gives that block"),
    ],
)
def test_results_that_differ_on_one_rank_raise_on_every_rank(dist_pool, kind, error, says):
    local = _differs(kind)
    assert local[0] == error
    assert says in local[1]
    got = dist_pool.run(_differs, kind, timeout=60)
    assert [g[0] for g in got] == [error] * 4
    assert all(says in g[1] for g in got)
    if kind == "raises":  # rank 2 raised its own error; the others raise it, naming rank 2
        assert got[2][2] == []
        assert got[0][2] == ["(raised on rank 2; this rank's function returned)"]


def _alike_answers() -> list[bool]:
    from fshard._exec.agree import _text_digest

    backend = fshard.shard(torch.zeros(4), fshard.Chunk(0, R)).backend
    mine = _text_digest(f"rank {dist.get_rank() // 2}")  # ranks 0, 1 alike; 2, 3 alike
    return [backend.alike(_text_digest("same")), backend.alike(mine), backend.alike(None)]


@pytest.mark.multiprocess
def test_alike_is_true_only_where_every_rank_passed_the_same_digest(dist_pool):
    assert dist_pool.run(_alike_answers, timeout=30) == [[True, False, False]] * 4


def _equal(differ: bool) -> tuple[bool, bool, dict[str, int]]:
    """equal and allclose of two arrays that differ on one block (rows 4-5, rank 2's) or nowhere."""
    x = fshard.shard(torch.arange(8.0), fshard.Chunk(0, R))
    y = fshard.map_local(lambda t: t + float(differ and t[0] == 4), x)
    with calls() as counts:
        same = fshard.equal(x, y)
        close = fshard.allclose(x, y)
    return same, close, counts


@pytest.mark.multiprocess
@pytest.mark.parametrize("differ", [False, True])
def test_equal_and_allclose_agree_in_one_all_reduce_each(dist_pool, differ):
    same, close, _ = _equal(differ)
    assert same is close is (not differ)  # the local backend's answer
    for got in dist_pool.run(_equal, differ, timeout=60):
        assert got == (same, close, {"all_reduce": 2, "all_to_all_single": 0})
