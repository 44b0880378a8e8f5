"""Check mode on 4 Gloo processes: an argument that is bad on one rank, a skipped
collective or a different call makes every rank raise, never hang, and the checks
a call posted end with it; outside check mode, a bad source tensor of
``shard(src=...)`` still raises on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _pool import outcome

import fshard
from fshard import CollectiveMismatchError, SpecError

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
X = torch.arange(96.0).reshape(8, 12)


_outcome = outcome


def _rank() -> int:
    return dist.get_rank()


def _a() -> fshard.ShardedArray:
    return fshard.shard(X, fshard.Chunk(0, R))


def _bad_dim_on_rank_3():
    a = _a()
    return _outcome(lambda: fshard.reshard(a, fshard.Chunk(5, R) if _rank() == 3 else fshard.Chunk(1, R)))


def _rank_7_on_rank_3():
    a = _a()
    return _outcome(lambda: fshard.reshard(a, fshard.Chunk(0, [0, 1, 2, 7] if _rank() == 3 else R)))


def _gather_to_9_on_rank_3():
    a = _a()
    return _outcome(lambda: fshard.gather(a, dst=9 if _rank() == 3 else 0))


def _map_local_raises_on_rank_1():
    a = _a()

    def fn(t):
        if _rank() == 1:
            raise ValueError("refused on rank 1")
        return t * 2

    def program():
        y = fshard.map_local(fn, a)
        fshard.gather(y)

    return _outcome(program)


def _check_mode_then_next(what: str) -> tuple[tuple[str, str, list[str]] | None, float]:
    """In check mode, a shard_map (or map_local) whose fn returns another structure (or raises) on rank 3 only.

    Then a gather outside check mode: no check of the failed call is left for it to raise.
    """
    x = fshard.shard(torch.arange(8.0).reshape(4, 2), fshard.Chunk(0, R))

    def fn(t: torch.Tensor) -> object:
        if t[0, 0] == 6:  # rank 3's block
            if what.endswith("raises"):
                raise ValueError("refused on rank 3")
            return (t, t)
        return t

    if what.startswith("shard_map"):
        rows = fshard.Chunk(0, R)
        call = fshard.shard_map(fn, in_specs=rows, out_specs=fshard.Layout((4, 2), x.layout.shards))
    else:
        call = lambda a: fshard.map_local(fn, a)  # noqa: E731
    got = _outcome(lambda: call(x), timeout=20.0)
    return got, fshard.gather(x).sum().item()


@pytest.mark.parametrize("what", ["shard_map-structure", "shard_map-raises", "map_local-raises"])
def test_check_mode_ends_the_checks_a_call_posts(dist_pool, what):
    got = dist_pool.run(_check_mode_then_next, what, timeout=60)
    for error, total in got:
        assert total == 28.0  # the next collective ran, on every rank
        assert error is not None
        if what.endswith("raises"):  # every rank raises rank 3's error
            assert error[:2] == ("ValueError", "refused on rank 3")
        else:
            assert error[0] == "SpecError"
            assert "another structure or other dtypes on ranks [3]" in error[1], error


ONE_RANK_ERRORS = {
    "reshard-to-a-dim-out-of-range": (_bad_dim_on_rank_3, 3, "SpecError"),
    "placement-on-a-rank-outside-the-group": (_rank_7_on_rank_3, 3, "SpecError"),
    "gather-to-a-rank-outside-the-group": (_gather_to_9_on_rank_3, 3, "SpecError"),
    "map_local-fn-raises-on-one-rank": (_map_local_raises_on_rank_1, 1, "ValueError"),
}


@pytest.mark.parametrize("case", sorted(ONE_RANK_ERRORS))
def test_an_error_on_one_rank_is_raised_on_every_rank(dist_pool, case):
    fn, bad, kind = ONE_RANK_ERRORS[case]
    got = dist_pool.run(fn, timeout=60)
    assert all(g is not None for g in got), got
    assert {g[0] for g in got} == {kind}, got
    assert len({g[1] for g in got}) == 1, "every rank raises the error the bad rank hit"
    assert got[bad][2] == []
    for r in R:
        if r != bad:
            assert any(f"raised on rank {bad}" in n for n in got[r][2]), got[r]


def _noop_reshard_on_rank_2():
    a = _a()
    return _outcome(lambda: fshard.reshard(a, fshard.Chunk(0, R) if _rank() == 2 else fshard.Chunk(1, R)))


def _equal_versus_shard():
    a = _a()
    if _rank() < 2:
        return _outcome(lambda: fshard.equal(a, a))
    return _outcome(lambda: fshard.shard(X if _rank() == 2 else None, fshard.Chunk(0, R), src=2))


@pytest.mark.parametrize("fn", [_noop_reshard_on_rank_2, _equal_versus_shard], ids=["no-op-reshard", "equal-vs-shard"])
def test_different_calls_raise_a_mismatch_on_every_rank(dist_pool, fn):
    got = dist_pool.run(fn, timeout=60)
    assert [g[0] if g else None for g in got] == ["CollectiveMismatchError"] * 4, got
    assert len({g[1] for g in got}) == 1
    if fn is _equal_versus_shard:
        assert "ranks [0, 1] called equal(" in got[0][1]
        assert "ranks [2, 3] called shard(" in got[0][1]


def _skip_the_last_collective():
    group = dist.new_group(R)  # a fresh group: the ranks part ways on it for good
    backend = fshard.backends.torch_dist.TorchDistBackend(group)
    a = fshard.shard(X, fshard.Chunk(0, R), backend=backend)
    if _rank() == 3:
        return None
    return _outcome(lambda: fshard.gather(a), timeout=2.0)


def test_a_rank_that_never_arrives_is_named_after_check_timeout(dist_pool):
    got = dist_pool.run(_skip_the_last_collective, timeout=60)
    assert got[3] is None
    for g in got[:3]:
        assert g[0] == "CollectiveMismatchError", g
        assert "ranks [3] of process group [0, 1, 2, 3] did not reach gather(" in g[1]
        assert "within 2 s" in g[1]


def _bad_source_tensor(kind: str, check: bool):
    bad = X.to_sparse() if kind == "sparse" else "not a tensor"
    t = bad if _rank() == 0 else None
    return _outcome(lambda: fshard.shard(t, fshard.Chunk(0, R), src=0), check=check)


@pytest.mark.parametrize("check", [False, True], ids=["check-off", "check-on"])
@pytest.mark.parametrize("kind", ["sparse", "str"])
def test_a_bad_source_tensor_raises_on_every_rank(dist_pool, kind, check):
    got = dist_pool.run(_bad_source_tensor, kind, check, timeout=60)
    want = "SpecError" if kind == "sparse" else "TypeError"
    assert [g[0] if g else None for g in got] == [want] * 4, got
    assert len({g[1] for g in got}) == 1
    assert "on rank 0" in got[0][1]


def _after_errors_the_ranks_still_agree():
    """The errors above leave every rank at the same check: matching calls pass."""
    a = _a()
    return _outcome(lambda: fshard.gather(fshard.reshard(a, fshard.Chunk(1, R))))


def test_ranks_stay_in_step_after_errors(dist_pool):
    dist_pool.run(_bad_dim_on_rank_3, timeout=60)
    dist_pool.run(_noop_reshard_on_rank_2, timeout=60)
    assert dist_pool.run(_after_errors_the_ranks_still_agree, timeout=60) == [None] * 4


def test_errors_are_typed():
    assert issubclass(CollectiveMismatchError, fshard.FShardError)
    assert issubclass(SpecError, ValueError)


# -- entry points that begin with a metadata exchange, and checkpoints ----------------


def _from_local_shards_versus_from_local_tensor():
    if _rank() < 2:
        mine = fshard.Shard(fshard.ShardMeta((2 * _rank(), 0), (2, 3), _rank()), torch.ones(2, 3))
        return _outcome(lambda: fshard.from_local_shards([mine], (4, 3)))
    return _outcome(lambda: fshard.from_local_tensor(torch.ones(2, 3)))


def _from_local_tensor_dim_5_on_rank_1():
    return _outcome(lambda: fshard.from_local_tensor(torch.ones(2, 3), dim=5 if _rank() == 1 else 0))


def _to_dtensor_with_different_meshes():
    from torch.distributed.device_mesh import init_device_mesh

    a = _a()
    line, grid = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))  # collective: every rank makes both
    return _outcome(lambda: fshard.to_dtensor(a, grid if _rank() == 2 else line))


def _load_with_different_specs(path: str):
    a = _a()
    fshard.save(path, {"a": a})
    spec = {"a": fshard.Chunk(1, R)} if _rank() == 3 else {"a": fshard.Chunk(0, R)}
    return _outcome(lambda: fshard.load(path, specs=spec))


def _save_an_unsaveable_leaf_on_rank_1(path: str):
    a = _a()
    tree = {"a": a, "extra": object() if _rank() == 1 else 1}
    return _outcome(lambda: fshard.save(path, tree))


@pytest.mark.parametrize(
    ("fn", "kinds"),
    [
        (_from_local_shards_versus_from_local_tensor, {"CollectiveMismatchError"}),
        (_from_local_tensor_dim_5_on_rank_1, {"CollectiveMismatchError", "SpecError", "IndexError"}),
        (_to_dtensor_with_different_meshes, {"CollectiveMismatchError"}),
    ],
    ids=["from_local_shards-vs-from_local_tensor", "from_local_tensor-dim-on-one-rank", "to_dtensor-meshes"],
)
def test_exchanges_name_their_calls(dist_pool, fn, kinds):
    got = dist_pool.run(fn, timeout=60)
    assert all(g is not None for g in got), got
    assert {g[0] for g in got} <= kinds, got
    assert len({g[0] for g in got}) == 1, "every rank raises the same kind of error"


@pytest.mark.parametrize("fn", [_load_with_different_specs, _save_an_unsaveable_leaf_on_rank_1], ids=["load", "save"])
def test_checkpoint_calls_that_differ_on_one_rank_raise_everywhere(dist_pool, tmp_path, fn):
    got = dist_pool.run(fn, str(tmp_path / "ckpt"), timeout=60)
    assert all(g is not None for g in got), got
    assert len({g[0] for g in got}) == 1, got
