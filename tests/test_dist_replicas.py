"""Data every rank must hold alike, on 4 Gloo processes: global tensors in check mode, and replicas.

A tensor passed to ``shard(t, spec)`` (``src=None``) or to a ``shard_map`` function is
the same on every rank; each rank's own rows are not, and in check mode every rank
raises naming the ranks. Copies of a replicated box that drift apart make
``check_replicas``, and in check mode ``gather`` and ``save``, raise on every rank.
"""

from __future__ import annotations

import os
import re

import optree
import pytest
import torch
import torch.distributed as dist
from _pool import outcome

import fshard
from fshard._exec import replicas as _replicas
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
TIMEOUT = 60.0


def _rank() -> int:
    return dist.get_rank()


def _collectives() -> int:
    return TorchDistBackend().counters.collectives


def _counted(fn, *, check: bool):
    """(what ``fn`` raised as ``outcome`` gives it, collectives it ran)."""
    before = _collectives()
    got = outcome(fn, check=check)
    return got, _collectives() - before


# -- a tensor where a global one is expected -----------------------------------------------------


def _shard_of(make, check: bool):
    return _counted(lambda: fshard.shard(make(_rank()), fshard.Chunk(0, R)), check=check)


def _rows_by_half(rank: int) -> torch.Tensor:
    return torch.arange(8.0).reshape(4, 2) + 100 * (rank // 2)  # ranks 0, 1 alike; 2, 3 alike


def _same_everywhere(rank: int) -> torch.Tensor:
    return torch.arange(8.0).reshape(4, 2)


def _negative_zero_on_rank_2(rank: int) -> torch.Tensor:
    return torch.tensor([0.0, -0.0 if rank == 2 else 0.0, 1.0, 2.0])


def _nan_payload_on_rank_1(rank: int) -> torch.Tensor:
    bits = torch.tensor([0x7FC00000 | (7 if rank == 1 else 1), 0, 0, 0], dtype=torch.int32)
    return bits.view(torch.float32)


def test_shard_of_per_rank_tensors_raises_on_every_rank_naming_the_ranks(dist_pool):
    got = dist_pool.run(_shard_of, _rows_by_half, True, timeout=TIMEOUT)
    errors, counts = [g[0] for g in got], [g[1] for g in got]
    assert len(set(map(str, errors))) == 1, "every rank raises the same error"
    kind, msg, _ = errors[0]
    assert kind == "CollectiveMismatchError"
    assert msg.startswith("shard()'s tensor argument (torch.float32, shape (4, 2)) (in shard(tensor=<this rank's own>")
    assert re.search(r"differs between ranks: ranks \[0, 1\] passed digest [0-9a-f]{8}, ranks \[2, 3\] passed", msg)
    assert "fshard.from_local_tensor(t, dim=0)" in msg
    assert "1/4 of it" in msg
    assert counts == [1, 1, 1, 1]  # one exchange of digests (check mode's store rounds are not collectives)


def test_shard_of_the_same_tensor_passes_with_one_exchange(dist_pool):
    got = dist_pool.run(_shard_of, _same_everywhere, True, timeout=TIMEOUT)
    assert [g[0] for g in got] == [None] * 4
    assert [g[1] for g in got] == [1, 1, 1, 1]


def test_shard_outside_check_mode_exchanges_nothing_and_raises_nothing(dist_pool):
    got = dist_pool.run(_shard_of, _rows_by_half, False, timeout=TIMEOUT)
    assert got == [(None, 0)] * 4


@pytest.mark.parametrize(
    ("make", "groups"),
    [(_negative_zero_on_rank_2, "ranks [0, 1, 3] passed digest"), (_nan_payload_on_rank_1, "ranks [0, 2, 3] passed")],
    ids=["negative-zero", "nan-payload"],
)
def test_shard_compares_bits_not_values(dist_pool, make, groups):
    got = dist_pool.run(_shard_of, make, True, timeout=TIMEOUT)
    assert len({str(g[0]) for g in got}) == 1
    assert got[0][0][0] == "CollectiveMismatchError"
    assert groups in got[0][0][1]


def _shard_map_of(make, check: bool):
    body = fshard.shard_map(lambda w, xb: xb @ w, (fshard.Replicated(R), fshard.Chunk(0, R)), fshard.Chunk(0, R))
    w = fshard.shard(torch.ones(2, 3), fshard.Replicated(R))
    return _counted(lambda: fshard.gather(body(w, make(_rank()))), check=check)


def test_shard_map_of_per_rank_tensors_raises_on_every_rank(dist_pool):
    got = dist_pool.run(_shard_map_of, _rows_by_half, True, timeout=TIMEOUT)
    assert len({str(g[0]) for g in got}) == 1
    kind, msg, _ = got[0][0]
    assert kind == "CollectiveMismatchError"
    assert msg.startswith("shard()'s tensor argument (torch.float32, shape (4, 2)) (in shard_map[")
    assert "ranks [0, 1] passed digest" in msg
    assert "ranks [2, 3] passed digest" in msg
    assert dist_pool.run(_shard_map_of, _same_everywhere, True, timeout=TIMEOUT)[0][0] is None


def _device_kind_on_rank_0():
    """Rank 0 hashes on the device, the others on the host: a second exchange, all on the device."""
    original = _replicas.kind_of
    if _rank() == 0:
        _replicas.kind_of = lambda t: "device"
    try:
        return _shard_of(_same_everywhere, True), _shard_of(_rows_by_half, True)[0]
    finally:
        _replicas.kind_of = original


def test_ranks_that_hash_differently_compare_by_one_kind(dist_pool):
    for (same, count), differ in dist_pool.run(_device_kind_on_rank_0, timeout=TIMEOUT):
        assert same is None
        assert count == 2
        assert differ[0] == "CollectiveMismatchError"
        assert "ranks [0, 1] passed digest" in differ[1]


# -- replicas ------------------------------------------------------------------------------------


def _own_copy(spec, shape, value) -> fshard.ShardedArray:
    """An array of ``spec`` whose shards on this rank hold ``value(rank)``: copies disagree where it says so."""
    layout = spec.layout(shape)
    mine = [fshard.Shard(m, torch.full(m.sizes, value(_rank()))) for m in layout.shards_on(_rank())]
    return fshard.from_local_shards_and_layout(mine, layout)


def _check_replicas_of(value, check: bool):
    tree = {
        "chunk": fshard.shard(torch.ones(8, 2), fshard.Chunk(0, R)),  # no copies
        "model": {"w": _own_copy(fshard.Named(fshard.Mesh((2, 2)), ("x", None)), (4, 2), value)},
        "b": _own_copy(fshard.Replicated(R), (3,), _two),
    }
    return _counted(lambda: fshard.check_replicas(tree), check=check)


def test_check_replicas_passes_on_equal_copies_with_one_exchange_for_the_tree(dist_pool):
    for check in (False, True):
        got = dist_pool.run(_check_replicas_of, _two, check, timeout=TIMEOUT)
        assert got == [(None, 1)] * 4


def _two(rank: int) -> float:
    return 2.0


def _rank_3_drifts(rank: int) -> float:
    return 5.0 if rank == 3 else 2.0


def test_check_replicas_raises_on_every_rank_naming_path_box_and_ranks(dist_pool):
    got = dist_pool.run(_check_replicas_of, _rank_3_drifts, False, timeout=TIMEOUT)
    assert len({str(g[0]) for g in got}) == 1
    assert [g[1] for g in got] == [1] * 4
    kind, msg, _ = got[0][0]
    assert kind == "ReplicaMismatchError"
    # Mesh (2, 2) with rows over x: rows 2:4 are held by ranks 2 and 3, and rank 3's copy drifted.
    assert msg.startswith(
        "check_replicas(): the copies of the ShardedArray at ['model']['w'] hold different data. "
        "Box [offsets (2, 0), sizes (2, 2)] has 2 values among its 2 copies: ranks [2] hold digest "
    )
    assert re.search(r"ranks \[3\] hold digest [0-9a-f]{8}\. The copies", msg)


def _gather_and_save_drifted(path: str):
    w = _own_copy(fshard.Replicated(R), (4,), lambda r: float(r % 2))
    good = fshard.shard(torch.ones(4), fshard.Replicated(R))
    gathered = outcome(lambda: fshard.gather(w))
    saved = outcome(lambda: fshard.save(path, {"good": good, "w": w}))
    read = fshard.gather(w).tolist()  # outside check mode
    quiet = (read, outcome(lambda: fshard.gather(good)), outcome(lambda: fshard.gather(good), check=False))
    return gathered, saved, quiet, os.path.exists(os.path.join(path, "index.json"))


def test_gather_and_save_in_check_mode_refuse_drifted_copies(dist_pool, tmp_path):
    got = dist_pool.run(_gather_and_save_drifted, str(tmp_path / "ck"), timeout=TIMEOUT)
    assert len({str(g[:2]) for g in got}) == 1
    gathered, saved, _, written = got[0]
    assert gathered[0] == "ReplicaMismatchError"
    assert "gather(): the copies of the array passed to gather() hold different data." in gathered[1]
    assert "ranks [0, 2] hold digest" in gathered[1]
    assert "ranks [1, 3] hold digest" in gathered[1]
    assert saved[0] == "ReplicaMismatchError"
    assert saved[1].startswith("fshard.save (nothing was written): the copies of the ShardedArray at ['w'] hold")
    assert not written
    for _, _, (values, checked_good, plain_good), _ in got:
        assert checked_good is None
        assert plain_good is None
        assert values in ([0.0] * 4, [1.0] * 4)  # outside check mode: one copy, silently


# -- the data-parallel recipe ---------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(32, 8, generator=torch.Generator().manual_seed(1)),
        torch.randn(32, 4, generator=torch.Generator().manual_seed(2)),
    )


def _data_parallel(per_rank_as_global: bool, rows: bool = False, waitless: bool = False):
    """docs/training.md's loop on replicated weights, each rank holding its own 8 rows (check mode on).

    ``per_rank_as_global``: the rows passed as the batch (wrong); else stacked with
    ``from_local_tensor`` and computed on with ``shard_map`` (docs/distributed.md).
    ``rows``: the weights split by rows (``Chunk(0)``) instead of replicated: no copies to drift.
    ``waitless``: docs/distributed.md's loop as written, ``from_local_tensor(..., even=True)`` and
    ``fshard.backward``.
    """
    old = fshard.config(check_collectives=True)
    try:
        model = _model()
        spec = fshard.Chunk(0, R) if rows else fshard.Replicated(R)
        params = fshard.shard_params(model, lambda name, t: spec)
        names = list(params)
        opt = torch.optim.AdamW([t.requires_grad_() for t in optree.tree_leaves(params)], lr=1e-2)
        x, y = _batch()
        mine = slice(8 * _rank(), 8 * _rank() + 8)

        def block_loss(*blocks):
            *ws, xb, yb = blocks
            out = torch.func.functional_call(model, dict(zip(names, ws)), (xb,))
            return torch.nn.functional.mse_loss(out, yb, reduction="sum")

        for step in range(3):  # noqa: B007  # the step an error names
            opt.zero_grad()
            if per_rank_as_global:
                full = {n: fshard.gather(v) for n, v in params.items()}
                loss = torch.nn.functional.mse_loss(torch.func.functional_call(model, full, (x[mine],)), y[mine])
            elif waitless:
                xs, ys = fshard.from_local_tensor((x[mine], y[mine]), dim=0, even=True)
                specs = (*[fshard.Replicated(R)] * len(names), xs.layout, ys.layout)
                body = fshard.shard_map(block_loss, specs, fshard.Partial(fshard.Replicated(R)))
                loss = fshard.backward(body(*params.values(), xs, ys) / y.numel())
            else:
                xs, ys = fshard.from_local_tensor(x[mine], dim=0), fshard.from_local_tensor(y[mine], dim=0)
                specs = (*[fshard.Replicated(R)] * len(names), xs.layout, ys.layout)
                body = fshard.shard_map(block_loss, specs, fshard.Partial(fshard.Replicated(R)))
                loss = fshard.gather(body(*params.values(), xs, ys)) / y.numel()
            if not waitless:
                loss.backward()
            opt.step()
        fshard.check_replicas(params)
        return None, {n: fshard.gather(v).detach() for n, v in params.items()}
    except fshard.FShardError as exc:
        return (type(exc).__name__, str(exc), step), None
    finally:
        fshard.config(check_collectives=old.check_collectives)


def _whole_batch_in_one_process() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch()
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("rows", [False, True], ids=["replicated", "rows"])
def test_per_rank_rows_passed_as_the_batch_are_caught_in_check_mode(dist_pool, rows):
    got = dist_pool.run(_data_parallel, True, rows, timeout=TIMEOUT)
    assert len({str(g) for g in got}) == 1
    (kind, msg, step), _ = got[0]
    # The first backward: the gathered weights' gradients differ between ranks, before any update.
    assert (kind, step) == ("CollectiveMismatchError", 0)
    assert "The gradient of a gathered tensor" in msg
    assert "from_local_tensor" in msg


@pytest.mark.parametrize("waitless", [False, True], ids=["gathered loss", "even and fshard.backward"])
def test_per_rank_rows_from_local_tensor_train_on_the_whole_batch(dist_pool, waitless):
    got = dist_pool.run(_data_parallel, False, False, waitless, timeout=TIMEOUT)
    want = _whole_batch_in_one_process()
    for error, params in got:
        assert error is None
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
