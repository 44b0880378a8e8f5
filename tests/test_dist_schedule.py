"""A rank's share of a plan, computed without a process group (pure functions of the layouts),
checked against the same share read from the global plan's rows; and a reshard, a scatter
and a gather on 4 Gloo processes that never build the global plan."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import fshard
from fshard._layout.show import describe_layout
from fshard.backends.torch_dist._choice import all_contiguous, direct, rows_in_order, smallest_piece
from fshard.backends.torch_dist._lowering import schedule

SHAPE = (8, 6)
CUTS = (8, 12)  # a shape where a 2 x 2 grid and 4 chunks cut along either dim


def _replicated_to(receivers, shape=SHAPE):
    return fshard.Replicated(receivers).layout(shape)


def test_gathering_dim0_chunks_receives_straight_into_the_result():
    rows = fshard.Chunk(0, [0, 1, 2, 3]).layout(SHAPE)
    assert all_contiguous(rows, _replicated_to([1]))
    assert all_contiguous(rows, _replicated_to([0, 1, 2, 3]))


@pytest.mark.parametrize(
    ("layout", "order", "expected"),
    [
        (fshard.Chunk(0, [0, 1, 2, 3]).layout(SHAPE), (0, 1, 2, 3), True),
        (fshard.Chunk(0, [0, 1, 2, 3]).layout((8,)), (0, 1, 2, 3), True),
        (fshard.Chunk(0, [3, 1]).layout(SHAPE), (3, 1), True),  # a sub-group, in its own order
        (fshard.Chunk(0, [1, 3]).layout(SHAPE), (3, 1), False),
        (fshard.Chunk(0, [3, 2, 1, 0]).layout(SHAPE), (0, 1, 2, 3), False),
        (fshard.Chunk(0, [0, 1, 2]).layout(SHAPE), (0, 1, 2), False),  # 3, 3, 2 rows
        (fshard.Chunk(0, [0, 1, 2, 3]).layout((0, 6)), (0, 1, 2, 3), False),  # nothing to gather
        (fshard.Chunk(0, [0, 1, 2, 3]).layout((8, 0)), (0, 1, 2, 3), False),
        (fshard.Chunk(1, [0, 1]).layout(SHAPE), (0, 1), False),
        (fshard.Chunk(0, [0, 1]).layout(SHAPE), (0, 1, 2, 3), False),  # not every rank of the group
        (fshard.Chunk(0, [0, 0, 1, 1]).layout(SHAPE), (0, 1), False),  # two shards on a rank
        (fshard.Replicated([0, 1]).layout(SHAPE), (0, 1), False),
        (fshard.Partial(fshard.Chunk(0, [0, 1])).layout(SHAPE), (0, 1), False),
        (fshard.Chunk(0, ["rank:0/cuda:0", "rank:1/cuda:1"]).layout(SHAPE), (0, 1), False),  # not the wire
    ],
)
def test_rows_in_order_is_what_all_gather_into_tensor_gathers(layout, order, expected):
    assert rows_in_order(layout, order, "cpu") is expected


def test_gathering_column_chunks_is_staged():
    cols = fshard.Chunk(1, [0, 1, 2, 3]).layout(SHAPE)
    assert not all_contiguous(cols, _replicated_to([1]))


def _two_copies_on_rank_1():
    return fshard.Layout(
        SHAPE,
        [
            fshard.ShardMeta((0, 0), (4, 6), fshard.Placement(1, "cpu")),
            fshard.ShardMeta((0, 0), (4, 6), fshard.Placement(1, "cpu:0")),
            fshard.ShardMeta((4, 0), (4, 6), 0),
        ],
    )


def test_each_box_is_sent_once_to_a_rank_that_holds_it_twice():
    src = fshard.Chunk(0, [0, 1]).layout(SHAPE)
    p = fshard.plan(src, _two_copies_on_rank_1())
    sender, receiver = schedule(p, 0, (0, 1)), schedule(p, 1, (0, 1))
    assert sender.sent == 24  # rows 0-4 once, not once per shard of rank 1
    assert sender.sent + receiver.sent == p.min_elements_sent
    assert [(peer, len(boxes)) for peer, boxes in sender.send] == [(1, 1)]
    ((peer, boxes),) = receiver.recv
    assert peer == 0
    assert len(boxes) == 1
    assert len(receiver.fanout[0]) == 1  # copied into rank 1's other shard too


def test_peers_follow_group_order_for_a_sub_group():
    src = fshard.Chunk(0, [3, 1, 2]).layout(SHAPE)
    dst = fshard.Chunk(1, [2, 3, 1]).layout(SHAPE)
    s = schedule(fshard.plan(src, dst), 1, (1, 2, 3))
    assert [peer for peer, _ in s.send] == [2, 3]
    assert [peer for peer, _ in s.recv] == [2, 3]
    s = schedule(fshard.plan(src, dst), 1, (3, 2, 1))
    assert [peer for peer, _ in s.send] == [3, 2]


def test_mismatch_descriptions_are_short_and_readable():
    lay = fshard.Chunk(0, list(range(8))).layout(SHAPE)
    text = describe_layout(lay)
    assert text.startswith("shape (8, 6): [0:1, 0:6]@0 [1:2, 0:6]@1")
    assert "... 2 more #" in text
    other = fshard.Chunk(0, [*range(7), 9]).layout(SHAPE)
    assert describe_layout(other).split("#")[0] == text.split("#")[0]  # the first boxes agree; the digest does not
    assert describe_layout(other) != text


# -- the schedule against the global plan's rows ------------------------------------------------

R4 = [0, 1, 2, 3]
LAYOUTS = {
    "rows": fshard.Chunk(0, R4).layout(CUTS),
    "cols": fshard.Chunk(1, R4).layout(CUTS),
    "cols-reversed": fshard.Chunk(1, R4[::-1]).layout(CUTS),
    "grid": fshard.Named(fshard.Mesh((2, 2)), ("x", "y")).layout(CUTS),
    "rows+replicas": fshard.Named(fshard.Mesh((2, 2)), ("x", None)).layout(CUTS),
    "two-ranks": fshard.Chunk(0, [2, 3]).layout(CUTS),
    "replicated": fshard.Replicated(R4).layout(CUTS),
    "eight-on-four": fshard.Chunk(1, [k % 4 for k in range(8)]).layout(CUTS),
    "uneven": fshard.Explicit(
        [((0, 0), (7, 5), 3), ((0, 5), (7, 7), 1), ((7, 0), (1, 12), 0), ((7, 0), (1, 12), 2)]
    ).layout(CUTS),
    "single-2": fshard.Single(2).layout(CUTS),
}
PAIRS = [(a, b) for a, b in itertools.product(LAYOUTS, LAYOUTS) if a != b]


def _at(layout, shard, lo, size):
    start = (np.asarray(lo) - layout.columns.lo[shard]).tolist()
    return int(shard), tuple(slice(a, a + n) for a, n in zip(start, np.asarray(size).tolist()))


def _from_rows(p, me, order):
    """Rank ``me``'s share read from the global plan's rows, as the backend read it before it
    had per-rank schedules: (local, send, recv, fanout, sent, send_split, recv_split)."""
    sr, dr = p.src_rank.tolist(), p.dst_rank.tolist()
    pos = {r: i for i, r in enumerate(order)}
    src_at = [_at(p.src, p.src_shard[k], p.lo[k], p.size[k]) for k in range(len(sr))]
    dst_at = [_at(p.dst, p.dst_shard[k], p.lo[k], p.size[k]) for k in range(len(sr))]
    key = [(int(p.src_shard[k]), tuple(p.lo[k].tolist()), tuple(p.size[k].tolist())) for k in range(len(sr))]
    local = [(src_at[k], dst_at[k]) for k in range(len(sr)) if sr[k] == me and dr[k] == me]
    sends, recvs = {}, {}
    for k in range(len(sr)):
        if sr[k] == me and dr[k] != me:
            sends.setdefault((dr[k], key[k]), k)
        if dr[k] == me and sr[k] != me:
            recvs.setdefault((sr[k], key[k]), []).append(k)
    numel = p.numel.tolist()
    send_rows = sorted(sends.values(), key=lambda k: (pos[dr[k]], k))
    recv_rows = sorted(recvs.values(), key=lambda rows: (pos[sr[rows[0]]], rows[0]))
    send_split, recv_split = [0] * len(order), [0] * len(order)
    for k in send_rows:
        send_split[pos[dr[k]]] += numel[k]
    for rows in recv_rows:
        recv_split[pos[sr[rows[0]]]] += numel[rows[0]]
    send = [(peer, tuple(src_at[k] for k in g)) for peer, g in itertools.groupby(send_rows, key=lambda k: dr[k])]
    recv = [
        (peer, tuple(dst_at[rows[0]] for rows in g))
        for peer, g in itertools.groupby(recv_rows, key=lambda rows: sr[rows[0]])
    ]
    fanout = [tuple(dst_at[k] for k in rows[1:]) for rows in recv_rows]
    sent = sum(numel[k] for k in send_rows)
    return local, send, recv, fanout, sent, send_split, recv_split


def _span_of(layout, boxes):
    """Where the boxes lie back to back in one shard, found with torch (an independent check)."""
    if not boxes or len({j for j, _ in boxes}) != 1:
        return None
    j = boxes[0][0]
    flat = torch.arange(int(np.prod(layout.columns.sz[j]))).reshape(tuple(layout.columns.sz[j].tolist()))
    views = [flat[at] for _, at in boxes]
    if any(v.numel() == 0 or not v.is_contiguous() for v in views):
        return None
    values = torch.cat([v.reshape(-1) for v in views])
    start = int(values[0]) if values.numel() else 0
    if not torch.equal(values, torch.arange(start, start + values.numel())):
        return None
    return j, start, start + values.numel()


def _check_against_rows(src, dst, order):
    p = fshard.plan(src, dst)
    for me in order:
        s = schedule(p, me, order)
        local, send, recv, fanout, sent, send_split, recv_split = _from_rows(p, me, order)
        assert list(s.local) == local
        assert [(peer, boxes) for peer, boxes in s.send] == send
        assert [(peer, boxes) for peer, boxes in s.recv] == recv
        assert list(s.fanout) == fanout
        assert s.sent == sent == p.for_rank(me).elements_sent
        assert list(s.send_split) == send_split
        assert list(s.recv_split) == recv_split
        assert s.send_span == _span_of(src, [at for _, boxes in s.send for at in boxes])
        assert s.recv_span == _span_of(dst, [at for _, boxes in s.recv for at in boxes])
    assert sum(schedule(p, me, order).sent for me in order) == p.elements_sent == p.min_elements_sent


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_schedule_equals_the_global_plans_rows(src, dst):
    _check_against_rows(LAYOUTS[src], LAYOUTS[dst], (0, 1, 2, 3))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_scatter_and_gather_schedules_equal_the_global_plans_rows(name):
    layout = LAYOUTS[name]
    for receivers in ((1,), (0, 1, 2, 3)):
        _check_against_rows(layout, _replicated_to(receivers, CUTS), (0, 1, 2, 3))  # gather
    _check_against_rows(_replicated_to((2,), CUTS), layout, (0, 1, 2, 3))  # shard(src=2)


def test_schedule_with_two_copies_and_a_sub_group_equals_the_rows():
    _check_against_rows(fshard.Chunk(0, [0, 1]).layout(SHAPE), _two_copies_on_rank_1(), (0, 1))
    _check_against_rows(fshard.Chunk(0, [3, 1, 2]).layout(SHAPE), fshard.Chunk(1, [2, 3, 1]).layout(SHAPE), (3, 2, 1))


# -- transport choices from the layouts against the rows -----------------------------------------


def _rows_all_contiguous(p):
    """Every box that crosses ranks is a range of its destination shard, read from the rows."""
    rows = np.flatnonzero(p.src_rank != p.dst_rank)
    if not rows.size or not p.dst.ndim:
        return True
    shape, size = p.dst.columns.sz[p.dst_shard[rows]], p.size[rows]
    big = size > 1
    lead = np.argmax(big, axis=1)
    after = np.arange(p.dst.ndim)[None, :] > lead[:, None]
    return bool((((size == shape) | ~after).all(axis=1) | ~big.any(axis=1)).all())


def _rows_smallest(p):
    return int(p.numel.min()) if len(p) else None


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_transport_choices_from_layouts_agree_with_the_rows(src, dst):
    a, b = LAYOUTS[src], LAYOUTS[dst]
    p = fshard.plan(a, b)
    if all_contiguous(a, b):  # never claims a box lands in place when it does not
        assert _rows_all_contiguous(p)
    if "uneven" not in (src, dst):  # chunks, grids and replicas: exactly the rows' answer
        assert all_contiguous(a, b) == _rows_all_contiguous(p)
    small = smallest_piece(a, b)
    assert small <= (_rows_smallest(p) or small)
    if "uneven" not in (src, dst) and len(p):
        assert small == _rows_smallest(p)


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        (fshard.Chunk(0, R4), fshard.Chunk(1, R4), False),  # in place at the receiver, but packed to send
        (fshard.Chunk(0, R4), fshard.Replicated(R4), True),
        (fshard.Chunk(1, R4), fshard.Chunk(0, R4), False),  # column blocks: staged on arrival
        (fshard.Named(fshard.Mesh((2, 2)), ("x", "y")), fshard.Chunk(0, R4), False),
        (fshard.Replicated(R4), fshard.Chunk(0, R4), False),  # nothing crosses ranks
    ],
)
def test_direct_for_16_mib(src, dst, expected):
    shape = (2048, 2048)  # 16 MiB of float32
    assert direct(src.layout(shape), dst.layout(shape), 4) is expected
    assert not direct(src.layout((256, 256)), dst.layout((256, 256)), 4)  # small boxes: one all_to_all


# -- on 4 processes, without the global plan ------------------------------------------------------


def _without_global_plan():
    """Runs a reshard, a scatter and a gather with every cache cleared and the global plan's
    rows forbidden; returns the elements this rank sent for each."""
    import torch.distributed as dist

    from fshard._plan import direct as _plan
    from fshard.backends.torch_dist import TorchDistBackend

    def forbidden(self):
        raise AssertionError("the global plan's rows were read")

    def build(*args):
        raise AssertionError("the global plan was built")

    rank, counters = dist.get_rank(), TorchDistBackend().counters
    x = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    # Chunk(0, R4) and Chunk(1, R4) as columns: no ShardMeta is made unless something asks for all.
    k = np.arange(4)
    rows = fshard.Layout.from_arrays(x.shape, np.c_[16 * k, 0 * k], np.c_[16 + 0 * k, 48 + 0 * k], R4)
    cols = fshard.Layout.from_arrays(x.shape, np.c_[0 * k, 12 * k], np.c_[64 + 0 * k, 12 + 0 * k], R4)
    fshard.clear_caches()
    rows_prop, build_fn = _plan.Plan.__dict__["_rows"], _plan._build
    _plan.Plan._rows, _plan._build = property(forbidden), build
    sent = []
    try:
        before = counters.elements_sent
        a = fshard.shard(x if rank == 1 else None, rows, src=1)
        sent.append(counters.elements_sent - before)
        before = counters.elements_sent
        b = fshard.reshard(a, cols)
        sent.append(counters.elements_sent - before)
        before = counters.elements_sent
        full = fshard.gather(b)
        sent.append(counters.elements_sent - before)
    finally:
        _plan.Plan._rows, _plan._build = rows_prop, build_fn
    # Nothing built one Python object per shard of the columnar layouts.
    assert rows._metas is None
    assert cols._metas is None
    (shard,) = b.addressable_shards
    assert torch.equal(shard.data, x[:, 12 * rank : 12 * rank + 12])
    assert torch.equal(full, x)
    return sent


@pytest.mark.multiprocess
def test_reshard_scatter_and_gather_run_without_the_global_plan(dist_pool):
    sent = dist_pool.run(_without_global_plan)
    shape = (64, 48)
    rows, cols = fshard.Chunk(0, R4).layout(shape), fshard.Chunk(1, R4).layout(shape)
    expected = [
        fshard.plan(fshard.Single(1).layout(shape), rows).min_elements_sent,
        fshard.plan(rows, cols).min_elements_sent,
        fshard.plan(cols, fshard.Replicated(R4).layout(shape)).min_elements_sent,
    ]
    assert [sum(column) for column in zip(*sent)] == expected
