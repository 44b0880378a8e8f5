"""How torch_dist packs what it sends and unpacks what it receives.

``_schedule.runs`` cuts a rank's boxes into runs that one strided ``copy_`` moves, and
``Schedule.exchange`` says how one ``all_to_all_single`` runs a rank's share: which
boxes are packed, which land in place, and whether the rank's own copies travel in its
own segment of the collective. The pure tests check the run detection on boxes, then
run every rank's exchange with the collective simulated in one process (the split
sizes cut the send buffers, as ``all_to_all_single`` does), against the plain tensor.
The multi-process tests run the same reshards on 4 Gloo processes: results equal
bit for bit, the elements sent equal the plan's minimum.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import fshard
from fshard.backends.torch_dist._lowering import Run, runs, schedule
from fshard.backends.torch_dist._transport import _pack, _region, _unpack

R4 = [0, 1, 2, 3]
ORDER = (0, 1, 2, 3)


def _runs(boxes):
    """``runs`` of boxes given as (shard, lo, size) tuples."""
    shard = np.array([b[0] for b in boxes], np.int64)
    lo = np.array([b[1] for b in boxes], np.int64).reshape(len(boxes), -1)
    size = np.array([b[2] for b in boxes], np.int64).reshape(len(boxes), -1)
    return runs(shard, lo, size)


# -- run detection ----------------------------------------------------------------------------


def test_equal_column_blocks_are_one_run_along_the_columns():
    (run,) = _runs([(0, (0, 4 * k), (6, 4)) for k in range(4)])
    assert run == Run(0, (slice(0, 6), slice(0, 16)), 1, 4, 4, (6, 4))
    assert run.numel == 96
    assert run.contiguous == (24, 4, 1)  # the strides of its 4 boxes back to back in a buffer


def test_a_gap_in_the_blocks_starts_a_new_run():
    got = _runs([(0, (0, 0), (6, 4)), (0, (0, 4), (6, 4)), (0, (0, 12), (6, 4))])  # the block at 8 stays home
    assert [(r.dim, r.copies, r.region) for r in got] == [
        (1, 2, (slice(0, 6), slice(0, 8))),
        (None, 1, (slice(0, 6), slice(12, 16))),
    ]


def test_blocks_with_a_fixed_stride_larger_than_their_extent_are_one_run():
    (run,) = _runs([(2, (1, 10 * k), (3, 4)) for k in range(3)])
    assert (run.dim, run.step, run.copies, run.region) == (1, 10, 3, (slice(1, 4), slice(0, 24)))


def test_the_same_box_for_every_peer_is_one_broadcast_run():
    (run,) = _runs([(1, (0, 0), (5, 8))] * 3)
    assert (run.dim, run.copies, run.region) == (-1, 3, (slice(0, 5), slice(0, 8)))


@pytest.mark.parametrize(
    "boxes",
    [
        [(0, (0, 4), (6, 4)), (0, (0, 0), (6, 4))],  # backwards
        [(0, (0, 0), (6, 4)), (1, (0, 4), (6, 4))],  # two shards
        [(0, (0, 0), (6, 4)), (0, (0, 4), (6, 3))],  # two shapes
        [(0, (0, 0), (2, 2)), (0, (2, 2), (2, 2))],  # a diagonal step
        [(0, (0, 0), (0, 4)), (0, (0, 4), (0, 4))],  # empty boxes
    ],
    ids=["backwards", "two-shards", "two-shapes", "diagonal", "empty"],
)
def test_boxes_that_do_not_follow_a_step_in_one_dim_stay_apart(boxes):
    assert [r.copies for r in _runs(boxes)] == [1, 1]


def test_runs_are_found_left_to_right():
    blocks = [(0, (0, 2 * k), (3, 2)) for k in (0, 1, 2)] + [(0, (0, 9), (3, 2)), (0, (0, 12), (3, 2))]
    assert [(r.copies, r.step) for r in _runs(blocks)] == [(3, 2), (2, 3)]


def test_zero_dimensional_boxes():
    (run,) = runs(np.zeros(3, np.int64), np.zeros((3, 0), np.int64), np.zeros((3, 0), np.int64))
    assert (run.dim, run.copies, run.shape) == (-1, 3, ())


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(48.0).view(6, 8),
        torch.arange(48.0).view(8, 6).t(),  # strided
        torch.complex(torch.arange(48.0), torch.ones(48)).view(6, 8).conj(),  # a lazy conjugate: sliced instead
        torch.arange(96.0).view(6, 16)[:, ::2],  # every other column
    ],
    ids=["contiguous", "transposed", "conj", "step-2"],
)
def test_a_run_is_one_view_of_its_boxes(tensor):
    cases = {
        (1, 2, 3): [(0, (1, 2 * k), (4, 2)) for k in range(3)],  # along the columns
        (0, 3, 2): [(0, (3 * k, 1), (2, 5)) for k in range(2)],  # along the rows, step past the extent
        (-1, 0, 3): [(0, (2, 2), (3, 3))] * 3,  # the same box thrice
    }
    for (dim, step, count), boxes in cases.items():
        (run,) = _runs(boxes)
        assert (run.dim, run.step, run.copies) == (dim, step, count)
        want = torch.stack([tensor[lo[0] : lo[0] + n[0], lo[1] : lo[1] + n[1]] for _, lo, n in boxes])
        assert torch.equal(_region({0: tensor}, run), want)


# -- the exchange a schedule chooses ----------------------------------------------------------


def _layouts(shape):
    mesh = fshard.Mesh((2, 2))
    rows, cols = shape
    return {
        "rows": fshard.Chunk(0, R4).layout(shape),
        "cols": fshard.Chunk(1, R4).layout(shape),
        "cols-reversed": fshard.Chunk(1, R4[::-1]).layout(shape),
        "grid": fshard.Named(mesh, ("x", "y")).layout(shape),
        "grid-rows": fshard.Named(mesh, (("x", "y"), None)).layout(shape),
        "rows+replicas": fshard.Named(mesh, ("x", None)).layout(shape),
        "replicated": fshard.Replicated(R4).layout(shape),
        "eight-on-four": fshard.Chunk(1, [k % 4 for k in range(8)]).layout(shape),
        "two-ranks": fshard.Chunk(0, [2, 3]).layout(shape),
        "explicit": fshard.Explicit(
            [
                ((0, 0), (rows - 1, 5), 3),
                ((0, 5), (rows - 1, cols - 5), 1),
                ((rows - 1, 0), (1, cols), 0),
                ((rows - 1, 0), (1, cols), 2),
            ]
        ).layout(shape),
    }


SHAPE = (8, 12)
UNEVEN = (10, 13)  # chunks of unequal sizes in both dims
LAYOUTS = _layouts(SHAPE)
PAIRS = [(a, b) for a, b in itertools.product(LAYOUTS, LAYOUTS) if a != b]


def test_dim0_to_dim1_receives_in_place_with_one_strided_pack():
    p = fshard.plan(LAYOUTS["rows"], LAYOUTS["cols"])
    for me in (1, 2):  # the own block lies between the peers': it goes through the collective
        ex = schedule(p, me, ORDER).exchange
        assert ex.local
        assert ex.send_split == ex.recv_split == (6,) * 4  # 2 rows x 3 columns to each rank, itself included
        (run,) = ex.send_runs  # one strided copy packs all four column blocks
        assert (run.dim, run.copies, run.shape) == (1, 4, (2, 3))
        assert ex.recv_span == (me, 0, 24)  # the whole output: no unpacking
    for me, span in ((0, (0, 6, 24)), (3, (3, 0, 18))):  # the own block at an end: copied locally
        ex = schedule(p, me, ORDER).exchange
        assert not ex.local
        assert ex.recv_span == span
        (run,) = ex.send_runs
        assert run.copies == 3


def test_grid_to_rows_keeps_its_own_copy_out_of_the_collective():
    p = fshard.plan(LAYOUTS["grid"], LAYOUTS["grid-rows"])
    for me in ORDER:
        s = schedule(p, me, ORDER)
        assert not s.exchange.local  # the sent half is already in place; nothing to gain
        assert s.exchange.send_span is not None
        assert sum(s.exchange.send_split) == s.sent


def _tensor(shape, dtype):
    n = int(np.prod(shape))
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    if dtype.is_complex:
        return torch.complex(torch.arange(n, dtype=torch.float32), -torch.arange(n, dtype=torch.float32)).reshape(shape)
    return torch.arange(n).to(dtype).reshape(shape)


def _box(t, layout, j):
    m = layout.shards[j]
    return t[tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))]


def _shards(full, layout, rank, contiguous=True):
    """This rank's source tensors; with ``contiguous=False`` each is a strided view."""
    out = {}
    for j in layout.indices_on(rank):
        box = _box(full, layout, j)
        out[j] = box.clone() if contiguous else box.t().contiguous().t()  # column-major
    return out


def _simulate(src, dst, full, *, contiguous=True):
    """Every rank's ``Schedule.exchange`` run in one process: pack, the collective (each
    rank's split of every send buffer to its peer), unpack, fan-out; the outputs per rank."""
    p = fshard.plan(src, dst)
    scheds = {me: schedule(p, me, ORDER) for me in ORDER}
    ins = {me: _shards(full, src, me, contiguous) for me in ORDER}
    outs = {me: {j: torch.empty(dst.shards[j].sizes, dtype=full.dtype) for j in dst.indices_on(me)} for me in ORDER}
    sendbufs = {}
    for me, s in scheds.items():
        ex = s.exchange
        sendbufs[me] = _pack(ex.send_runs, ins[me], torch.empty(sum(ex.send_split), dtype=full.dtype))
        if not ex.local:
            for read, write in s.local:
                outs[me][write[0]][write[1]].copy_(ins[me][read[0]][read[1]])
    for me, s in scheds.items():
        ex = s.exchange
        parts = []
        for peer in ORDER:
            theirs = scheds[peer].exchange
            start = sum(theirs.send_split[: ORDER.index(me)])
            parts.append(sendbufs[peer][start : start + theirs.send_split[ORDER.index(me)]])
            assert parts[-1].numel() == ex.recv_split[ORDER.index(peer)]
        recvbuf = torch.cat(parts)
        _unpack(ex.recv_runs, recvbuf, outs[me])
        for at, shape, targets in ex.fanout:
            for j, where in targets:
                outs[me][j][where].copy_(recvbuf[at : at + int(np.prod(shape))].view(shape))
    return outs


def _check_simulated(src, dst, full, **kwargs):
    outs = _simulate(src, dst, full, **kwargs)
    for me, tensors in outs.items():
        for j, t in tensors.items():
            assert torch.equal(t, _box(full, dst, j)), (me, j)


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_every_exchange_moves_the_right_elements(src, dst):
    full = _tensor(SHAPE, torch.float32)
    _check_simulated(LAYOUTS[src], LAYOUTS[dst], full)


@pytest.mark.parametrize(
    ("src", "dst"), [("rows", "cols"), ("grid", "rows"), ("explicit", "cols"), ("cols", "rows+replicas")]
)
@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.int64, torch.float16])
def test_uneven_chunks_and_dtypes(src, dst, dtype):
    layouts = _layouts(UNEVEN)
    _check_simulated(layouts[src], layouts[dst], _tensor(UNEVEN, dtype))


@pytest.mark.parametrize(("src", "dst"), [("rows", "cols"), ("grid", "grid-rows"), ("rows+replicas", "cols")])
def test_strided_inputs(src, dst):
    _check_simulated(LAYOUTS[src], LAYOUTS[dst], _tensor(SHAPE, torch.float32), contiguous=False)


def test_the_sent_elements_stay_the_plans_minimum():
    for src, dst in PAIRS:
        p = fshard.plan(LAYOUTS[src], LAYOUTS[dst])
        assert sum(schedule(p, me, ORDER).sent for me in ORDER) == p.min_elements_sent


# -- on 4 Gloo processes ------------------------------------------------------------------------


def _spec(name, shape):
    return _layouts(shape)[name]


def _reshard_on_ranks(src_name, dst_name, shape, dtype_name, strided):
    """Reshards a tensor of ``shape`` (``strided``: from non-contiguous local tensors); returns
    the elements this rank sent, after checking its shards bit for bit."""
    import torch.distributed as dist

    from fshard.backends.torch_dist import TorchDistBackend

    rank = dist.get_rank()
    full = _tensor(shape, getattr(torch, dtype_name))
    src, dst = _spec(src_name, shape), _spec(dst_name, shape)
    parts = []
    for m in src.shards_on(rank):
        box = full[tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))]
        if strided and box.ndim == 2:
            box = box.t().contiguous().t()
            assert box.numel() <= 1 or min(box.shape) <= 1 or not box.is_contiguous()
        parts.append(fshard.Shard(m, box))
    x = fshard.from_local_shards_and_layout(parts, src)
    counters = TorchDistBackend().counters
    before = counters.elements_sent
    y = fshard.reshard(x, dst)
    sent = counters.elements_sent - before
    for s in y.addressable_shards:
        want = full[tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))]
        assert s.data.dtype == want.dtype
        assert torch.equal(s.data, want)
    return sent


CASES = [
    ("rows", "cols", SHAPE, "float32", False),
    ("rows", "cols", UNEVEN, "bool", False),
    ("rows", "cols", (512, 512), "float32", False),  # 64 KiB blocks
    ("rows", "cols", (1024, 1024), "float32", True),  # 1 MiB blocks from strided shards
    ("grid", "grid-rows", UNEVEN, "complex64", False),
    ("explicit", "rows", UNEVEN, "int64", False),
    ("cols", "rows+replicas", SHAPE, "int32", True),
    ("rows+replicas", "cols", UNEVEN, "float64", True),
    ("rows", "replicated", (1024, 1024), "float32", True),  # 1 MiB pieces: one message each, packed once
    ("cols", "replicated", UNEVEN, "int16", False),
    ("replicated", "cols", SHAPE, "bool", False),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_reshards_on_four_processes(dist_pool, case):
    src_name, dst_name, shape, _, _ = case
    sent = dist_pool.run(_reshard_on_ranks, *case, timeout=120)
    assert sum(sent) == fshard.plan(_spec(src_name, shape), _spec(dst_name, shape)).min_elements_sent


def _scatter_columns(shape, dtype_name):
    """``shard(src=0)`` to column chunks: rank 0 packs the column blocks with one strided copy."""
    import torch.distributed as dist

    from fshard.backends.torch_dist import TorchDistBackend

    rank = dist.get_rank()
    full = _tensor(shape, getattr(torch, dtype_name))
    counters = TorchDistBackend().counters
    before = counters.elements_sent
    y = fshard.shard(full if rank == 0 else None, fshard.Chunk(1, R4), src=0)
    sent = counters.elements_sent - before
    (s,) = y.addressable_shards
    assert torch.equal(s.data, full[:, s.meta.offsets[1] : s.meta.offsets[1] + s.meta.sizes[1]])
    return sent


@pytest.mark.multiprocess
@pytest.mark.parametrize(("shape", "dtype"), [(UNEVEN, "complex64"), ((64, 4096), "bool")])
def test_scatter_of_column_blocks(dist_pool, shape, dtype):
    sent = dist_pool.run(_scatter_columns, shape, dtype, timeout=120)
    src, dst = fshard.Single(0).layout(shape), fshard.Chunk(1, R4).layout(shape)
    assert sum(sent) == fshard.plan(src, dst).min_elements_sent
