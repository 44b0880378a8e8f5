"""psum inside shard_map bodies on 4 Gloo processes: the local backend's values and gradients.

Each program of tests/psum_programs.py runs once here (local backend) and once on the pool;
the two agree within float64 rounding (1e-12), and both match the dense reference.
"""

from __future__ import annotations

import math
import re

import psum_programs as programs
import pytest
import torch

import fshard
from fshard.testing.launch import launch

pytestmark = pytest.mark.multiprocess


def _on_four(name: str) -> bool:
    return programs.CASES[name][0] in ((2, 2), (4,))


def _max_error(a: list, b: list) -> float:
    return float((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max())


@pytest.mark.parametrize("name", sorted(n for n in programs.CASES if _on_four(n)))
def test_gloo_matches_local_and_dense(dist_pool, name):
    local = programs.sharded(name)
    dense = programs.dense(name)
    for rank, (value, grad) in enumerate(dist_pool.run(programs.sharded, name, timeout=60)):
        assert _max_error(value, local[0]) <= 1e-12, f"rank {rank}"
        assert _max_error(grad, local[1]) <= 1e-12, f"rank {rank}"
        assert _max_error(grad, dense[1]) <= 1e-12, f"rank {rank}"


RANDOM_ON_FOUR = [s for s in range(64) if math.prod(programs.random_case(s)[0][0]) == 4][:4]


@pytest.mark.parametrize("seed", RANDOM_ON_FOUR)
def test_random_programs_on_gloo_match_local_and_dense(dist_pool, seed):
    case, shape = programs.random_case(seed)
    local = programs.sharded("random", case=case, shape=shape)
    dense = programs.dense("random", case=case, shape=shape)
    for rank, (value, grad) in enumerate(dist_pool.run(programs.sharded, "random", case=case, shape=shape, timeout=60)):
        assert _max_error(value, local[0]) <= 1e-12, f"rank {rank}: {case}"
        assert _max_error(grad, local[1]) <= 1e-12, f"rank {rank}: {case}"
        assert _max_error(grad, dense[1]) <= 1e-12, f"rank {rank}: {case}"


def _flat_psum_counts() -> tuple[list[float], int, int]:
    ranks = [0, 1, 2, 3]
    out = fshard.Chunk(0, ranks).layout((8,))  # a Layout: no exchange of the blocks' shapes
    f = fshard.shard_map(lambda b: fshard.psum(b, "x"), in_specs=fshard.Chunk(0, ranks), out_specs=out)
    x = fshard.shard(torch.arange(8.0), fshard.Chunk(0, ranks))
    counters = x.backend.counters
    before = (counters.collectives, counters.elements_sent)
    y = f(x)
    moved = (counters.collectives - before[0], counters.elements_sent - before[1])
    return fshard.gather(y).tolist(), *moved


def test_one_all_reduce_per_psum(dist_pool):
    for got, collectives, sent in dist_pool.run(_flat_psum_counts, timeout=60):
        assert got == [12.0, 16.0] * 4
        # One all-reduce of 2 elements and 4 counts (of the placements whose summand records a gradient, or not,
        # and has a tangent, or not): 2 * 3 * 6 // 4 sent per rank; and the posted check of what fn returned (its
        # two elements are no movement's).
        assert (collectives, sent) == (2, 9)


def _in_check_mode(fn):
    old = fshard.config(check_collectives=True)
    try:
        return fn()
    except fshard.CollectiveMismatchError as exc:
        return str(exc)
    finally:
        fshard.config(check_collectives=old.check_collectives)


def _checked_program():
    return _in_check_mode(lambda: programs.sharded("2d-over-tp"))


def test_check_mode_passes_a_program_that_reduces_alike(dist_pool):
    local = programs.sharded("2d-over-tp")
    for value, grad in dist_pool.run(_checked_program, timeout=60):
        assert _max_error(value, local[0]) <= 1e-12
        assert _max_error(grad, local[1]) <= 1e-12


def _checked_dtype_mismatch():
    import torch.distributed as dist

    ranks = [0, 1, 2, 3]
    wide = dist.get_rank() == 3

    def body(b):
        return fshard.psum(b.double() if wide else b, "x").float()

    f = fshard.shard_map(body, in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks))
    return _in_check_mode(lambda: f(torch.arange(4.0)))


def test_check_mode_names_a_psum_whose_dtype_differs_on_one_rank(dist_pool):
    for rank, msg in enumerate(dist_pool.run(_checked_dtype_mismatch, timeout=60)):
        assert isinstance(msg, str), f"rank {rank} raised nothing"
        assert "ranks [0, 1, 2] called shard_map[" in msg
        assert "ranks [3] called shard_map[" in msg
        assert "at psum #" in msg


def test_a_closed_over_weight_gets_the_sum_of_its_uses_on_gloo(dist_pool):
    dense = programs.closed_over(sharded_run=False)
    for rank, grad in enumerate(dist_pool.run(programs.closed_over, timeout=60)):
        assert _max_error(grad, dense) <= 1e-12, f"rank {rank}"


def _psum_unlike(kind: str) -> str:
    """A body whose placements reduce unlike each other: over other axes, or more often (rank 3 fewer)."""
    old = fshard.config(timeout=3.0)
    try:
        mesh = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
        spec = fshard.Named(mesh, ("dp", "tp"))

        def body(a: torch.Tensor) -> torch.Tensor:
            last = bool(a.sum() < 0)  # the placement (dp=1, tp=1) alone
            if kind == "none":  # alike: over tp, then over dp
                return fshard.psum(fshard.psum(a, "tp"), "dp")
            if kind == "axes":
                return fshard.psum(a, "dp" if last else "tp")
            s = fshard.psum(a.sum()[None], "tp")
            return a * (s if last else fshard.psum(s, "tp"))

        x = torch.arange(1.0, 17.0).reshape(4, 4)
        x[2:, 2:] *= -1
        try:
            fshard.gather(fshard.shard_map(body, spec, spec, check_vma=False)(x))
        except (fshard.CollectiveMismatchError, fshard.SpecError) as exc:
            return str(exc)
        return "no error"
    finally:
        fshard.config(timeout=old.timeout)


@pytest.mark.multiprocess
def test_bodies_that_reduce_over_other_axes_raise_on_every_rank_at_the_first_use():
    """The processes compare the partition before they make its groups: new_group pairs calls by order alone,
    so rank 3, summing over dp where the others sum over tp, summed with the wrong rank, and no rank raised.

    New processes: the pool's have made both partitions' groups (the case below).
    """
    got = launch(_psum_unlike, 4, "axes", timeout=120)
    assert all("sum over other axes than this rank" in m for m in got), got
    assert "ranks [3] sum over other axes" in got[0]
    assert "ranks [0, 1, 2] sum over other axes" in got[3]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["axes", "count"])
def test_bodies_that_reduce_unlike_each_other_raise_on_every_rank(dist_pool, kind):
    """Over groups made before, or a psum fewer on one placement: a sum, on a group of its own, waits at most
    config(timeout=...), then raises (it hung, and a sum over the whole job paired with another collective);
    the ranks whose sums completed raise at their next collective, with the others."""
    dist_pool.run(_psum_unlike, "none", timeout=60)  # every partition's groups made, alike
    try:
        got = dist_pool.run(_psum_unlike, kind, timeout=60)
    finally:
        dist_pool.restart()  # a sum left in flight on purpose
    assert all(m != "no error" for m in got), got
    # The sum's own wait, or the comparison after the bodies on a rank whose sum completed: bounded either way.
    assert any(re.search(r"did not (all )?arrive within 3 s", m) for m in got), got


def _sums_over_overlapping_subsets() -> list:
    """psum in shard_maps over subsets of the job that share ranks ([3, 1] then [3, 0], ...): no group per subset."""
    out = []
    for ranks in ([3, 1], [3, 0], [0, 1], [0, 2], [0, 1, 3], [2, 1, 0]):
        x = torch.arange(3.0 * len(ranks), dtype=torch.float64, requires_grad=True)
        f = fshard.shard_map(
            lambda b: fshard.psum(b * b, "x"), fshard.Chunk(0, ranks), fshard.Replicated(ranks), check_vma=False
        )
        y = fshard.gather(f(x))
        y.sum().backward()
        n = fshard.shard_map(  # fewer elements than ranks, integers
            lambda b: fshard.psum(b[:1], "x"), fshard.Chunk(0, ranks), fshard.Replicated(ranks), check_vma=False
        )(torch.arange(len(ranks)) + 1)
        out.append((y.tolist(), x.grad.tolist(), fshard.gather(n).tolist()))
    return out


def test_psums_over_subsets_that_share_ranks_match_local(dist_pool):
    old = fshard.config(timeout=60.0)
    try:
        local = _sums_over_overlapping_subsets()
    finally:
        fshard.config(timeout=old.timeout)
    assert local[0][2] == [3]
    assert dist_pool.run(_sums_over_overlapping_subsets, timeout=120) == [local] * 4


def _forward_mode_through_psum() -> list[list[bool]]:
    """Forward-mode AD (``torch.autograd.forward_ad``) through a psum body: primal and tangent against dense."""
    import torch.autograd.forward_ad as fw

    g = torch.Generator().manual_seed(0)
    x, w, tx, tw = (torch.randn(*s, dtype=torch.float64, generator=g) for s in ((4, 6), (6, 3), (4, 6), (6, 3)))
    with fw.dual_level():
        dense = fw.unpack_dual(torch.tanh(fw.make_dual(x, tx) @ fw.make_dual(w, tw)))
    out = []
    for ranks in ([0, 1, 2], [0, 1, 2, 3]):  # also over 3 of 4 processes: rank 3 runs no body and no sum
        f = fshard.shard_map(
            lambda a, b: torch.tanh(fshard.psum(a @ b, "x")),
            (fshard.Chunk(1, ranks), fshard.Chunk(0, ranks)),
            fshard.Replicated(ranks),
            check_vma=False,
        )
        with fw.dual_level():
            got = fw.unpack_dual(fshard.gather(f(fw.make_dual(x, tx), fw.make_dual(w, tw))))
        out.append([torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, dense)])
    return out


def test_forward_mode_ad_through_psum_sums_the_tangents(dist_pool):
    assert _forward_mode_through_psum() == [[True, True]] * 2  # the local backend: bodies in threads
    assert dist_pool.run(_forward_mode_through_psum, timeout=90) == [[[True, True]] * 2] * 4


def _psum_unlike_in_autograd(kind: str) -> str:
    """A psum whose summand records a gradient (or has a tangent) on some placements only, or a body that
    differentiates through its own psum: the local backend summed what one process cannot, and processes hung
    (a backward sum that rank 0 never joined), failed with Gloo's own error, or gave n times the gradient."""
    import torch.autograd.forward_ad as fw

    ranks = [0, 1, 2, 3]
    x = torch.arange(1.0, 5.0, dtype=torch.float64, requires_grad=kind == "grad inside")
    w = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)

    def body(b: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
        if kind == "records":
            return fshard.psum(b * wb if b.sum() > 1.5 else b, "x") * wb  # placement 0's summand leaves w out
        if kind == "tangent":
            return fshard.psum(b * b if b.sum() > 1.5 else b.detach(), "x")
        y = fshard.psum(b**3, "x")
        return torch.autograd.grad(y.sum(), b)[0]

    f = fshard.shard_map(
        body, in_specs=(fshard.Chunk(0, ranks), fshard.Replicated(ranks)), out_specs=fshard.Chunk(0, ranks)
    )
    try:
        if kind == "tangent":
            with fw.dual_level():
                fshard.gather(f(fw.make_dual(x, torch.ones(4, dtype=torch.float64)), w))
        else:
            fshard.gather(f(x, w)).sum().backward()
    except (fshard.CollectiveMismatchError, fshard.SpecError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("records", "CollectiveMismatchError: psum() of a tensor that records a gradient on 3 of the 4 placements"),
        ("tangent", "CollectiveMismatchError: psum() of a tensor that has a forward-mode tangent on 3 of the 4"),
        ("grad inside", "SpecError: The backward of a psum() ran inside a shard_map body"),
    ],
)
def test_a_psum_that_placements_differentiate_unlike_raises_alike_on_both_backends(dist_pool, kind, error):
    assert _psum_unlike_in_autograd(kind).startswith(error)
    got = dist_pool.run(_psum_unlike_in_autograd, kind, timeout=90)
    assert all(m.startswith(error) for m in got), got
    assert dist_pool.run(_flat_psum_counts, timeout=60)[0][0] == [12.0, 16.0] * 4  # the group still works


def _psum_by_messages_left_waiting() -> tuple[str, str]:
    """A psum over 3 of 4 ranks (by messages, not a group's all-reduce) whose rank 2 never sums."""
    import time

    import torch.distributed as dist

    fshard.config(timeout=2.0)
    mesh = fshard.Mesh((3,), ranks=[0, 1, 2])
    rank = dist.get_rank()

    def body(t: torch.Tensor) -> torch.Tensor:
        if rank == 2:
            time.sleep(6)
            return t
        return fshard.psum(t, "x")

    f = fshard.shard_map(body, fshard.Named(mesh, ("x",)), fshard.Named(mesh, ("x",)), check_vma=False)
    start = time.monotonic()
    try:
        f(torch.arange(6.0))
        got = "no error", ""
    except Exception as exc:
        got = type(exc).__name__, str(exc)
    # No rank leaves before every other has raised: a process that exits closes its connections, and a rank
    # still waiting then gets Gloo's "Connection closed by peer" rather than its own timeout.
    time.sleep(max(0.0, start + 12 - time.monotonic()))
    return got


def test_a_psum_by_messages_left_waiting_raises_a_typed_error_in_time():
    """Gloo ends a point-to-point wait past its timeout with "Application timeout caused pair closure", which
    the waits let through untyped as no timeout; new processes, as the sum is left in flight."""
    got = launch(_psum_by_messages_left_waiting, 4, timeout=120)
    for rank in (0, 1, 3):
        kind, message = got[rank]
        assert kind == "CollectiveMismatchError", got
        assert "within 2 s" in message, got


def _summed_with_unlike_neighbours() -> str:
    from test_psum import _summed_with_unlike_neighbours as program  # the local test's program

    try:
        program()(torch.zeros(1), torch.arange(18.0).reshape(6, 3))
    except fshard.SpecError as exc:
        return str(exc)
    return "no error"


def test_a_claim_of_replicas_whose_psum_groups_hold_unlike_blocks_is_refused_on_every_rank(dist_pool):
    for rank, msg in enumerate(dist_pool.run(_summed_with_unlike_neighbours, timeout=60)):
        assert "gives the placements that fn's psum over ('a',) sums with them different blocks" in msg, (rank, msg)
