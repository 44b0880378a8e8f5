"""The worker pool itself: failures carry the rank's traceback, hangs time out and restart it."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _pool import RankFailure

pytestmark = pytest.mark.multiprocess


def _rank():
    return dist.get_rank(), dist.get_world_size()


def _fails_on_rank_two():
    if dist.get_rank() == 2:
        raise ValueError("rank two disagrees")
    return "fine"


def _rank_zero_skips_the_barrier():
    if dist.get_rank() != 0:
        dist.barrier()


def test_pool_runs_a_function_on_every_rank(dist_pool):
    assert dist_pool.run(_rank) == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_failure_names_the_rank_and_its_traceback(dist_pool):
    with pytest.raises(
        RankFailure, match=r"failed on ranks \[2\]:\n--- rank 2 ---\n(.|\n)*ValueError: rank two disagrees"
    ):
        dist_pool.run(_fails_on_rank_two)
    assert dist_pool.run(_rank)[2] == (2, 4)


def test_hang_times_out_naming_the_test_and_restarts_the_pool(dist_pool):
    starts = dist_pool.starts
    with pytest.raises(
        TimeoutError, match=r"test_hang_times_out_naming_the_test.*did not finish on every rank within 3 s"
    ):
        dist_pool.run(_rank_zero_skips_the_barrier, timeout=3)
    assert dist_pool.starts == starts + 1
    assert dist_pool.run(_rank) == [(0, 4), (1, 4), (2, 4), (3, 4)]
