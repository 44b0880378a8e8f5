"""from_local_shards / from_local_tensor: one metadata exchange, the same error on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard._api.dist import Piece, Report, check_pieces

RANKS = [0, 1, 2, 3]
SHAPE = (10, 20)
X = torch.arange(200.0).reshape(SHAPE)


def _rows(lo, n, rank, x=X):
    meta = fshard.ShardMeta((lo, 0), (n, x.shape[1]), rank)
    return fshard.Shard(meta, x[lo : lo + n].clone())


def _valid():
    rank = dist.get_rank()
    # Rank r holds rows [3r, 3r + 3) (rank 3: one row) and, on ranks 0 and 1, nothing else.
    a = fshard.from_local_shards([_rows(3 * rank, 3 if rank < 3 else 1, rank)], SHAPE)
    assert a.layout == fshard.Chunk(0, RANKS).layout(SHAPE)
    assert torch.equal(fshard.gather(a), X)
    # Several shards per rank, and a rank with none.
    mine = [_rows(r0, 1, rank) for r0 in range(10) if r0 % 3 == rank]
    b = fshard.from_local_shards(mine, list(SHAPE))
    assert len(b.addressable_shards) == len(mine)
    assert torch.equal(fshard.gather(b), X)
    assert fshard.equal(a, b)
    return [s.placement.rank for s in b.layout.shards]


@pytest.mark.multiprocess
def test_from_local_shards_valid(dist_pool):
    got = dist_pool.run(_valid)
    assert got == [[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]] * 4


def _invalid(case):
    rank = dist.get_rank()
    shards, shape = [_rows(3 * rank, 3 if rank < 3 else 1, rank)], SHAPE
    if case == "overlap":
        shards = [_rows(2 * rank, 3 if rank < 3 else 4, rank)]
    elif case == "gap":
        shards = [_rows(2 * rank, 2, rank)]
    elif case == "different-global-size":
        shape = (10, 30) if rank == 0 else SHAPE
    elif case == "wrong-global-size":
        shape = (12, 20)
    elif case == "dtype" and rank == 1:
        shards = [fshard.Shard(shards[0].meta, shards[0].data.double())]
    elif case == "requires_grad" and rank == 2:
        shards = [fshard.Shard(shards[0].meta, shards[0].data.requires_grad_())]
    elif case == "other-rank" and rank == 1:
        shards = [_rows(3, 3, 2)]
    elif case == "not-a-shard" and rank == 3:
        shards = [X[9:]]
    with pytest.raises((fshard.LayoutError, TypeError)) as info:
        fshard.from_local_shards(shards, shape)
    return type(info.value).__name__, str(info.value)


INVALID = {
    "overlap": "Shards 0 [offsets (0, 0), sizes (3, 20)] on rank:0/cpu and 1 [offsets (2, 0), sizes (3, 20)] "
    "on rank:1/cpu overlap",
    "gap": "do not cover element (8, 0)",
    "different-global-size": "global size does not match across ranks: rank 0 (10, 30), rank 1 (10, 20)",
    "wrong-global-size": "do not cover element (10, 0)",
    "dtype": "dtype property need to be the same on all ranks! Found dtype=torch.float32 on rank 0",
    "requires_grad": "requires_grad property need to be the same on all ranks! Found requires_grad=False on rank 0",
    "other-rank": "rank 1: shard [offsets (3, 0), sizes (3, 20)] on rank:2/cpu names rank 2, but rank 1 passed it",
    "not-a-shard": "rank 3: item 0 is a Tensor, not an fshard.Shard",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(INVALID))
def test_from_local_shards_invalid_raises_the_same_error_on_every_rank(dist_pool, case):
    errors = dist_pool.run(_invalid, case)
    assert len(set(errors)) == 1, errors
    kind, message = errors[0]
    assert kind == ("TypeError" if case == "not-a-shard" else "LayoutError")
    assert INVALID[case] in message, message


def _from_local_tensor():
    rank = dist.get_rank()
    a = fshard.from_local_tensor(torch.full((rank + 1, 3), float(rank)))
    assert tuple(a.shape) == (10, 3)
    assert [s.offsets for s in a.layout.shards] == [(0, 0), (1, 0), (3, 0), (6, 0)]
    expected = torch.cat([torch.full((r + 1, 3), float(r)) for r in RANKS])
    assert torch.equal(fshard.gather(a), expected)
    b = fshard.from_local_tensor(torch.full((2, rank), float(rank)), dim=-1)  # rank 0's block is empty
    assert tuple(b.shape) == (2, 6)
    with pytest.raises(fshard.SpecError, match="blocks may differ only in dim 0"):
        fshard.from_local_tensor(torch.zeros(2, 3 + (rank == 2)))
    with pytest.raises(fshard.SpecError, match="Invalid sharding dim"):
        fshard.from_local_tensor(torch.zeros(2, 3), dim=2)


@pytest.mark.multiprocess
def test_from_local_tensor(dist_pool):
    dist_pool.run(_from_local_tensor)


def _from_local_tree():
    from fshard.backends.torch_dist import TorchDistBackend

    rank, counters = dist.get_rank(), TorchDistBackend().counters
    rows, targets = torch.full((rank + 1, 3), float(rank)), torch.arange(rank + 1)
    before = counters.collectives
    tree = fshard.from_local_tensor({"x": rows, "y": targets}, dim=0)
    exchanges = counters.collectives - before
    alone = [fshard.from_local_tensor(rows), fshard.from_local_tensor(targets)]
    same = [tree["x"].layout == alone[0].layout, tree["y"].layout == alone[1].layout]
    same += [torch.equal(fshard.gather(tree[k]), fshard.gather(a)) for k, a in zip("xy", alone)]
    with pytest.raises(fshard.SpecError, match="trees of different sizes"):
        fshard.from_local_tensor([rows] * (1 + (rank == 3)), dim=0)
    return exchanges, same


@pytest.mark.multiprocess
def test_from_local_tensor_of_a_tree_exchanges_once(dist_pool):
    for exchanges, same in dist_pool.run(_from_local_tree, timeout=60):
        assert exchanges == 1
        assert all(same)


def _from_local_even():
    from fshard.backends.torch_dist import TorchDistBackend, _later

    rank, counters = dist.get_rank(), TorchDistBackend().counters
    rows, targets = torch.full((2, 3), float(rank)), torch.arange(2) + 2 * rank
    before = counters.collectives
    tree = fshard.from_local_tensor({"x": rows, "y": targets}, dim=0, even=True)
    posted = counters.collectives - before  # the check waits for the next one posted, or the next collective
    in_flight = _later.pending(None)  # nothing waited for yet
    exchanged = fshard.from_local_tensor({"x": rows, "y": targets}, dim=0)  # that collective ends it
    settled = _later.pending(None)
    same = [tree[k].layout == exchanged[k].layout for k in "xy"]
    same += [torch.equal(fshard.gather(tree[k]), fshard.gather(exchanged[k])) for k in "xy"]
    one = fshard.from_local_tensor(torch.full((1, 2), float(rank), requires_grad=True), dim=1, even=True)
    same += [tuple(one.shape) == (1, 8), one.requires_grad, fshard.gather(one).tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]]
    old = fshard.config(check_collectives=True)  # check mode: every rank's call is compared too
    try:
        checked = fshard.from_local_tensor(rows, dim=0, even=True)
        same.append(tuple(fshard.gather(checked).shape) == (8, 3))
    finally:
        fshard.config(check_collectives=old.check_collectives)
    return posted, in_flight, settled, same


@pytest.mark.multiprocess
def test_from_local_tensor_even_leaves_its_check_to_the_next_collective_which_ends_it(dist_pool):
    for posted, in_flight, settled, same in dist_pool.run(_from_local_even, timeout=60):
        assert (posted, in_flight, settled) == (0, 1, 0)
        assert all(same), same


def _even_refused(case):
    rank = dist.get_rank()
    rows = torch.ones(2 + (case == "size" and rank == 2) + (case == "size0" and rank == 0), 3)
    at_call = None
    try:
        if case == "failed" and rank == 3:
            fshard.from_local_tensor((rows, "not a tensor"), dim=0, even=True)
        else:
            fshard.from_local_tensor((rows, rows), dim=0, even=True)
    except TypeError as exc:
        at_call = str(exc)
    loss_of = fshard.shard_map(
        lambda b: b.sum()[None], in_specs=(fshard.Chunk(0, RANKS),), out_specs=fshard.Partial(fshard.Replicated(RANKS))
    )
    with pytest.raises(fshard.SpecError) as info:  # the next collective, on every rank
        fshard.gather(loss_of(fshard.shard(torch.ones(8), fshard.Chunk(0, RANKS))))
    fshard.gather(fshard.shard(torch.ones(4), fshard.Chunk(0, RANKS)))  # the group is usable after
    return at_call, str(info.value)


@pytest.mark.multiprocess
def test_from_local_tensor_even_refusals_reach_every_rank_at_the_next_collective(dist_pool):
    sizes = dist_pool.run(_even_refused, "size", timeout=60)
    assert {at for at, _ in sizes} == {None}
    assert len({m for _, m in sizes}) == 2  # each rank names its own blocks
    for k, (_, message) in enumerate(sizes):
        assert "from_local_tensor(dim=0, even=True): ranks [2] passed blocks unlike those of ranks [0, 1, 3]" in message
        assert f"this rank passed ({3 if k == 2 else 2}, 3) torch.float32" in message
        assert "drop even=True" in message
    for _, message in dist_pool.run(_even_refused, "size0", timeout=60):  # the odd one is named, rank 0 too
        assert "ranks [0] passed blocks unlike those of ranks [1, 2, 3]" in message
    failed = dist_pool.run(_even_refused, "failed", timeout=60)
    assert [at is not None for at, _ in failed] == [False, False, False, True]
    assert "a tuple, list or dict of them" in str(failed[3][0])
    for _, message in failed:
        assert message.startswith("from_local_tensor(dim=0, even=True) raised on rank(s) [3], whose error says why")


def _even_failed_in_check_mode() -> list[str]:
    """Check mode: a rank's own error at the call reaches every rank there, and only there."""
    old = fshard.config(check_collectives=True)
    try:
        rows = torch.zeros(2) if dist.get_rank() == 1 else torch.zeros(2, 3)  # dim=1: out of range on rank 1
        with pytest.raises(fshard.SpecError) as info:
            fshard.from_local_tensor(rows, dim=1, even=True)
        after = fshard.gather(fshard.from_local_tensor(torch.ones(2, 3), dim=0, even=True))  # no second error
        return [str(info.value), str(tuple(after.shape))]
    finally:
        fshard.config(check_collectives=old.check_collectives)


@pytest.mark.multiprocess
def test_from_local_tensor_even_raises_once_in_check_mode(dist_pool):
    for message, shape in dist_pool.run(_even_failed_in_check_mode, timeout=60):
        assert "Invalid sharding dim: 1 for 1-D local tensors" in message
        assert shape == "(8, 3)"


def test_an_even_mismatch_names_the_ranks_unlike_most_and_abbreviates_the_others():
    from fshard._api.dist import _even_verdict

    many = _even_verdict([(r, False, 2 if r == 5 else 1) for r in range(20)], "f", "mine")
    assert "ranks [5] passed blocks unlike those of ranks [0, 1, ..., 19] (19 ranks)" in str(many)
    tie = _even_verdict([(0, False, 1), (1, False, 2)], "f", "mine")  # equally many: the lowest rank's are the usual
    assert "ranks [1] passed blocks unlike those of ranks [0]" in str(tie)
    assert _even_verdict([(0, False, 1), (1, True, 0)], "f", "mine", raised_alike=True) is None  # raised at the call
    assert _even_verdict([(0, False, 1), (1, False, 1)], "f", "mine") is None


def _even_alike():
    """Blocks alike, described alike: a structure whose repr holds an address, dims counted from either end."""
    import collections

    rank = dist.get_rank()
    batch = collections.defaultdict(lambda: None, {"x": torch.zeros(2, 3), "y": (torch.ones(2), torch.ones(2, 1))})
    tree = fshard.from_local_tensor(batch, dim=0, even=True)
    rows = fshard.from_local_tensor(torch.zeros(3, 2), dim=-1 if rank % 2 else 1, even=True)  # the same dim
    got = [tuple(fshard.gather(tree["x"]).shape), tuple(fshard.gather(rows).shape)]
    with pytest.raises(fshard.SpecError, match="Invalid sharding dim") as info:  # every rank fails alike
        fshard.from_local_tensor(torch.zeros(()), dim=0, even=True)
    got.append(str(info.value))
    got.append(float(fshard.gather(fshard.shard(torch.ones(4), fshard.Chunk(0, RANKS))).sum()))  # no second error
    # A structure that cannot be hashed (its default factory): its digest is made afresh at each call.
    unhashable = collections.defaultdict(_Unhashable(), {"x": torch.zeros(2, 3)})
    for _ in range(2):
        got.append(tuple(fshard.gather(fshard.from_local_tensor(unhashable, dim=0, even=True)["x"]).shape))
    return got


class _Unhashable:
    """A default factory that cannot be hashed, nor a tree that holds it."""

    __hash__ = None  # type: ignore[assignment]

    def __call__(self) -> None:
        return None


@pytest.mark.multiprocess
def test_from_local_tensor_even_compares_blocks_not_their_reprs_and_raises_once_where_every_rank_fails(dist_pool):
    for got in dist_pool.run(_even_alike, timeout=60):
        assert got[:2] == [(8, 3), (3, 8)]
        assert "0-D local tensors" in got[2]
        assert got[3] == 4.0
        assert got[4:] == [(8, 3), (8, 3)]


def test_from_local_tensor_even_in_one_process_and_its_refusals():
    a = fshard.from_local_tensor((torch.zeros(4, 3), torch.ones(4)), dim=0, even=True)
    b = fshard.from_local_tensor((torch.zeros(4, 3), torch.ones(4)), dim=0)
    assert [x.layout for x in a] == [x.layout for x in b]
    with pytest.raises(TypeError, match="even must be a bool, got 1"):
        fshard.from_local_tensor(torch.zeros(2), dim=0, even=1)
    with pytest.raises(TypeError, match="takes no shape"):
        fshard.from_local_tensor(torch.zeros(2), dim=0, shape=(2,), even=True)


def test_from_local_tensor_of_a_tree_in_one_process_and_its_refusals():
    xs, ys = fshard.from_local_tensor((torch.zeros(4, 3), torch.ones(4)), dim=0)
    assert (tuple(xs.shape), tuple(ys.shape)) == ((4, 3), (4,))
    for bad in ([], [torch.zeros(2), 3], fshard.shard(torch.zeros(2), fshard.Chunk(0, [0]))):
        with pytest.raises(TypeError, match="a tuple, list or dict of them"):
            fshard.from_local_tensor(bad, dim=0)


# -- single process: the checks themselves, and the local backend ---------------------------


def _piece(rank, lo, **props):
    base = {"dtype": torch.float32, "device": "cpu", "requires_grad": False, "pinned": False, "layout": "torch.strided"}
    return Piece(fshard.ShardMeta((lo,), (2,), rank), **(base | props))


def test_pin_memory_mismatch_across_ranks_names_both():
    reports = [Report(0, (4,), (_piece(0, 0),), ()), Report(1, (4,), (_piece(1, 2, pinned=True),), ())]
    with pytest.raises(fshard.LayoutError, match="pinned property need to be the same on all ranks") as info:
        check_pieces(reports)
    assert "pinned=False on rank 0" in str(info.value)
    assert "pinned=True on rank 1" in str(info.value)


def test_device_type_mismatch_across_ranks():
    reports = [Report(0, (4,), (_piece(0, 0),), ()), Report(1, (4,), (_piece(1, 2, device="cuda:1"),), ())]
    with pytest.raises(fshard.LayoutError, match="device_type property need to be the same"):
        check_pieces(reports)


def test_check_pieces_returns_the_layout():
    reports = [Report(0, (4,), (_piece(0, 0),), ()), Report(1, (4,), (_piece(1, 2),), ())]
    assert check_pieces(reports) == fshard.Chunk(0, [0, 1]).layout((4,))


def test_from_local_shards_on_the_local_backend_takes_every_rank():
    parts = [_rows(5 * r, 5, r) for r in (0, 1)]
    a = fshard.from_local_shards(parts, SHAPE)
    assert torch.equal(fshard.gather(a), X)
    with pytest.raises(fshard.LayoutError, match="overlap"):
        fshard.from_local_shards([*parts, _rows(3, 4, 2)], SHAPE)
    with pytest.raises(TypeError, match=r"not an fshard\.Shard"):
        fshard.from_local_shards([X], SHAPE)
    with pytest.raises(fshard.LayoutError, match="dtype property"):
        fshard.from_local_shards([parts[0], fshard.Shard(parts[1].meta, parts[1].data.half())], SHAPE)


def test_from_local_shards_on_the_local_backend_lists_the_shards_rank_by_rank():
    # Given out of rank order in one list (no process per rank could): the same layout as across processes.
    parts = [_rows(5, 5, 1), _rows(0, 5, 0)]
    a = fshard.from_local_shards(parts, SHAPE)
    assert [m.placement.rank for m in a.layout.shards] == [0, 1]
    assert a.layout == fshard.Chunk(0, [0, 1]).layout(SHAPE)
    assert torch.equal(fshard.gather(a + fshard.shard(X, fshard.Chunk(0, [0, 1]))), 2 * X)
    with pytest.raises(TypeError, match=r"item 1 is a Tensor, not an fshard\.Shard"):  # named where it was given
        fshard.from_local_shards([parts[0], X], SHAPE)


def test_from_local_shards_empty_array_keeps_its_dtype():
    a = fshard.from_local_shards(
        [fshard.Shard(fshard.ShardMeta((0,), (0,), 0), torch.zeros(0, dtype=torch.int8))], (0,)
    )
    assert a.dtype == torch.int8


def _sub_group():
    rank = dist.get_rank()
    pg = dist.new_group([1, 2, 3])
    if rank == 0:
        with pytest.raises(
            fshard.SpecError, match=r"from_local_shards, equal, \.\.\.\): rank 0 is not in the process group"
        ):
            fshard.from_local_shards([], SHAPE, group=pg)
        return None
    rows = {1: (0, 4), 2: (4, 4), 3: (8, 2)}[rank]
    a = fshard.from_local_shards([_rows(*rows, rank)], SHAPE, group=pg)
    assert a.layout.ranks == (1, 2, 3)
    assert torch.equal(fshard.gather(a), X)
    b = fshard.from_local_tensor(X[2 * rank : 2 * rank + 2], group=pg)  # rows 2-8, stacked in group order
    assert torch.equal(fshard.gather(b), X[2:8])
    with pytest.raises(fshard.LayoutError, match="names rank 1, but rank 2 passed it"):
        fshard.from_local_shards([_rows(*rows, 1 if rank == 2 else rank)], SHAPE, group=pg)
    return [str(s.placement) for s in a.layout.shards]


@pytest.mark.multiprocess
def test_from_local_shards_on_a_sub_group(dist_pool):
    assert dist_pool.run(_sub_group) == [None] + [["rank:1/cpu", "rank:2/cpu", "rank:3/cpu"]] * 3


def _step_of(rows: torch.Tensor, fail_here: bool = False) -> tuple[int, str, str]:
    """A data-parallel forward: a batch ``from_local_tensor(even=True)``, then a shard_map that moves nothing.

    Returns the collectives the two calls started, and the errors (or "") of the batch's call
    and of the next collective (a gather of the loss).
    """
    from fshard.backends.torch_dist import TorchDistBackend

    counters = TorchDistBackend().counters
    rep = fshard.Replicated(RANKS)
    w = fshard.shard(torch.ones(3), rep)
    before = counters.collectives
    own = ""
    try:
        xs = fshard.from_local_tensor(rows, dim=1 if fail_here else 0, even=True)
        loss = fshard.shard_map(lambda xb, wb: (xb @ wb).sum()[None], in_specs=(fshard.Chunk(0, RANKS), rep),
                                out_specs=fshard.Partial(rep))(xs, w)  # fmt: skip
    except fshard.SpecError as e:
        own, loss = str(e), None
    started = counters.collectives - before
    later = ""
    try:
        if loss is not None:
            fshard.gather(loss)
        else:  # this rank raised at the call: its next collective
            fshard.gather(fshard.shard(torch.ones(4), fshard.Chunk(0, RANKS)))
    except fshard.SpecError as e:
        later = str(e)
    return started, own, later


def _one_gather_for_both() -> list[tuple[int, str, str]]:
    rank = dist.get_rank()
    alike = _step_of(torch.ones(2, 3))
    unlike = _step_of(torch.ones(3 if rank == 2 else 2, 3))  # rank 2's batch has another shape
    failed = _step_of(torch.ones(2) if rank == 1 else torch.ones(2, 3), fail_here=rank == 1)  # dim 1 of 1-D: rank 1
    return [alike, unlike, failed]


@pytest.mark.multiprocess
def test_a_batchs_check_goes_with_the_next_call_s_check_in_one_gather_and_every_rank_still_raises(dist_pool):
    for rank, (alike, unlike, failed) in enumerate(dist_pool.run(_one_gather_for_both, timeout=60)):
        assert alike == (1, "", "")  # the batch's check and the shard_map's outcome: one gather
        assert unlike[:2] == (1, "")
        assert "ranks [2] passed blocks unlike those of ranks [0, 1, 3]" in unlike[2]  # at the next collective
        if rank == 1:  # its own error at the call, posted at once; again at its next collective, with the others
            assert failed[0] == 1
            assert "Invalid sharding dim: 1 for 1-D local tensors" in failed[1]
        else:
            assert failed[:2] == (1, "")
        assert "raised on rank(s) [1]" in failed[2]


def test_frames_are_cut_alike_where_one_rank_failed():
    from fshard.backends.torch_dist import _later

    def record(what: str, width: int, failed: bool = False) -> _later._Record:
        return _later._Record(what, failed, tuple(range(width)), width, lambda pairs: None)

    batch, outcome = record("from_local_tensor(dim=0)", 1), record("shard_map()", 2)
    queued: list[_later._Record] = []
    for _ in range(2):  # two batches' checks wait (4 numbers each: the queue's 8)
        frames, queued = _later._cut(queued, batch, defer=True)
        assert frames == []
    frames, left = _later._cut(queued, batch, defer=True)  # a third: those waiting go first
    assert [len(f) for f in frames] == [2]
    assert left == [batch]
    frames, left = _later._cut(left, outcome, defer=False)  # then the call's check, with it: one frame
    assert [len(f) for f in frames] == [2]
    assert left == []
    # Where the third failed, that rank posts its frames at once: the same two, so they pair with the others'.
    failed_frames, left = _later._cut(queued, record("from_local_tensor(dim=0)", 1, failed=True), defer=True)
    assert [len(f) for f in failed_frames] == [2, 1]
    assert left == []
    assert all(1 + sum(len(r.numbers()) for r in f) <= _later._FRAME for f in [*frames, *failed_frames])


def test_a_rank_whose_frame_lacks_a_record_or_holds_another_calls_is_named():
    from fshard.backends.torch_dist import _later

    def record(what: str, digest: tuple[int, ...]) -> _later._Record:
        return _later._Record(what, False, digest, len(digest), lambda pairs: ValueError(repr(pairs)))

    mine = [record("from_local_tensor(dim=0)", (7,)), record("shard_map()", (8, 9))]

    def frame(records: list[_later._Record]) -> list[int]:
        numbers = [len(records), *(n for r in records for n in r.numbers())]
        return numbers + [0] * (_later._FRAME - len(numbers))

    rows = [frame(mine), frame(mine[:1])]  # rank 1 posted the first only
    assert str(_later._verdict(mine[0], 0, (0, 1), rows)) == "[(0, False, (7,)), (1, False, (7,))]"
    assert "rank 1 posted no check of this call" in str(_later._verdict(mine[1], 1, (0, 1), rows))
    rows = [frame(mine), frame([record("gather(dim=0)", (7,)), mine[1]])]  # rank 1's first is another call's
    assert "rank 1 posted no check of this call" in str(_later._verdict(mine[0], 0, (0, 1), rows))
    assert str(_later._verdict(mine[1], 1, (0, 1), rows)) == "[(0, False, (8, 9)), (1, False, (8, 9))]"
    garbage_rows = ([3, *[10**6] * 15], [99, *[2] * 15], [2, 1, 0, 30, *[0] * 12], [2, 1, 0, -40, *[0] * 12])
    for garbage in garbage_rows:  # a gather paired wrongly: no frame
        rows = [frame(mine), garbage]
        assert all("rank 1 posted no check" in str(_later._verdict(r, k, (0, 1), rows)) for k, r in enumerate(mine))
