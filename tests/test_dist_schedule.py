"""A rank's share of a plan, computed without a process group (pure functions of the plan)."""

from __future__ import annotations

import fshard
from fshard.backends.torch_dist._check import describe_layout
from fshard.backends.torch_dist._schedule import all_contiguous, schedule

SHAPE = (8, 6)


def _replicated_to(receivers):
    return fshard.Replicated(receivers).layout(SHAPE)


def test_gathering_dim0_chunks_receives_straight_into_the_result():
    rows = fshard.Chunk(0, [0, 1, 2, 3]).layout(SHAPE)
    assert all_contiguous(fshard.plan(rows, _replicated_to([1])))
    assert all_contiguous(fshard.plan(rows, _replicated_to([0, 1, 2, 3])))


def test_gathering_column_chunks_is_staged():
    cols = fshard.Chunk(1, [0, 1, 2, 3]).layout(SHAPE)
    assert not all_contiguous(fshard.plan(cols, _replicated_to([1])))


def test_each_box_is_sent_once_to_a_rank_that_holds_it_twice():
    src = fshard.Chunk(0, [0, 1]).layout(SHAPE)
    dst = fshard.Layout(
        SHAPE,
        [
            fshard.ShardMeta((0, 0), (4, 6), fshard.Placement(1, "cpu")),
            fshard.ShardMeta((0, 0), (4, 6), fshard.Placement(1, "cpu:0")),
            fshard.ShardMeta((4, 0), (4, 6), 0),
        ],
    )
    p = fshard.plan(src, dst)
    sender, receiver = schedule(p, 0, (0, 1)), schedule(p, 1, (0, 1))
    assert sender.sent == 24  # rows 0-4 once, not once per shard of rank 1
    assert sender.sent + receiver.sent == p.min_elements_sent
    assert [(peer, len(rows)) for peer, rows in sender.send] == [(1, 1)]
    ((peer, rows),) = receiver.recv
    assert peer == 0
    assert len(receiver.fanout[int(rows[0])]) == 2  # copied into both of rank 1's shards


def test_peers_follow_group_order_for_a_sub_group():
    src = fshard.Chunk(0, [3, 1, 2]).layout(SHAPE)
    dst = fshard.Chunk(1, [2, 3, 1]).layout(SHAPE)
    s = schedule(fshard.plan(src, dst), 1, (1, 2, 3))
    assert [peer for peer, _ in s.send] == [2, 3]
    assert [peer for peer, _ in s.recv] == [2, 3]


def test_mismatch_descriptions_are_short_and_readable():
    lay = fshard.Chunk(0, list(range(8))).layout(SHAPE)
    text = describe_layout(lay)
    assert text.startswith("shape (8, 6): [0:1, 0:6]@0 [1:2, 0:6]@1")
    assert "... 2 more #" in text
    other = fshard.Chunk(0, [*range(7), 9]).layout(SHAPE)
    assert describe_layout(other).split("#")[0] == text.split("#")[0]  # the first boxes agree; the digest does not
    assert describe_layout(other) != text
