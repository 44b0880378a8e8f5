"""config(timeout=...): a rank stuck outside a movement makes the others raise after the
timeout, naming the ranks that did not arrive, instead of blocking for the process group's."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

import fshard

RANKS = [0, 1, 2, 3]
SMALL = torch.arange(96.0).reshape(8, 12)  # its data travels with the headers
BIG = torch.arange(float(1 << 16)).reshape(256, 256)  # a round of headers, then the data


def _late(call, late: float):
    """Rank 3 makes ``call`` ``late`` seconds after the others, under a 1 s timeout; each rank's outcome and seconds."""
    old = fshard.config(timeout=1.0)
    try:
        if dist.get_rank() == 3:
            time.sleep(late)
        start = time.monotonic()
        try:
            call()
        except fshard.CollectiveMismatchError as exc:
            return str(exc), time.monotonic() - start
        return "no error", time.monotonic() - start
    finally:
        fshard.config(timeout=old.timeout)


def _straggler(x, late: float):
    """Rank 3 reaches the reshard ``late`` seconds after the others."""
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    return _late(lambda: fshard.reshard(a, fshard.Chunk(1, RANKS)), late)


@pytest.mark.multiprocess
@pytest.mark.parametrize("x", [SMALL, BIG], ids=["inline", "header-round"])
def test_ranks_that_do_not_arrive_are_named_after_the_timeout(dist_pool, x):
    try:
        got = dist_pool.run(_straggler, x, 5.0, timeout=30)
    finally:
        dist_pool.restart()  # the timed-out collectives were left in flight on purpose
    for message, seconds in got[:3]:
        assert message.startswith(
            "reshard: ranks [3] of process group [0, 1, 2, 3] did not arrive within 1 s (config(timeout=...))"
        ), message
        assert "this process group cannot be used again" in message
        assert 0.9 < seconds < 4.0, seconds  # bounded by the timeout, not by the straggler's 5 s
    if x is SMALL:  # the straggler found every header, and the data with them, when it came
        assert got[3][0] == "no error"
    else:  # it passed the headers, then waited for data that the others never sent
        assert got[3][0].startswith("reshard: some ranks of process group [0, 1, 2, 3] did not arrive within 1 s")


def _in_time():
    old = fshard.config(timeout=30.0)
    try:
        a = fshard.shard(BIG, fshard.Chunk(0, RANKS))
        return fshard.gather(fshard.reshard(a, fshard.Chunk(1, RANKS))).equal(BIG)
    finally:
        fshard.config(timeout=old.timeout)


@pytest.mark.multiprocess
def test_a_timeout_that_every_rank_meets_changes_nothing(dist_pool):
    assert dist_pool.run(_in_time, timeout=60) == [True] * 4


def test_timeout_defaults_to_the_process_groups_and_takes_positive_seconds():
    assert fshard._config.Config().timeout is None
    old = fshard.config(timeout=2)
    try:
        assert fshard.config().timeout == 2.0
        assert type(fshard.config(timeout=None).timeout) is float
    finally:
        fshard.config(timeout=old.timeout)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, fshard.SpecError, "timeout=0: give a positive, finite number of seconds"),
        (float("inf"), fshard.SpecError, "timeout=inf: give a positive, finite number of seconds"),
        ("5", TypeError, "timeout='5' is a str: give a number of seconds"),
        (True, TypeError, "timeout=True is a bool: give a number of seconds"),
    ],
    ids=["zero", "infinite", "string", "bool"],
)
def test_bad_timeouts_are_refused(value, error, match):
    with pytest.raises(error, match=re.escape(match)):
        fshard.config(timeout=value)
    assert fshard.config().timeout is None


def _late_to_an_exchange(case: str, late: float):
    """Rank 3 reaches a call whose first collective is an exchange of metadata ``late`` seconds after the others."""
    a = fshard.shard(SMALL, fshard.Chunk(0, RANKS))
    calls = {
        "shard(src=0)": lambda: fshard.shard(SMALL, fshard.Chunk(0, RANKS), src=0),
        "from_local_tensor": lambda: fshard.from_local_tensor(SMALL[:2], dim=0),
        "equal": lambda: fshard.equal(a, a),
    }
    return _late(calls[case], late)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["shard(src=0)", "from_local_tensor", "equal"])
def test_an_exchange_of_metadata_is_bounded_by_the_timeout_too(dist_pool, case):
    try:
        got = dist_pool.run(_late_to_an_exchange, case, 5.0, timeout=30)
    finally:
        dist_pool.restart()  # the timed-out collectives were left in flight on purpose
    for message, seconds in got[:3]:
        assert re.match(
            r"an? (exchange of metadata|comparison of digests): some ranks of process group \[0, 1, 2, 3\] did not "
            r"arrive within 1 s \(config\(timeout=\.\.\.\)\)",
            message,
        ), message
        assert 0.9 < seconds < 4.0, seconds  # bounded by the timeout, not by the straggler's 5 s
