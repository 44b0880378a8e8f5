"""The single-process scenarios of torch's test_sharded_tensor.py, in fshard terms.

Each test names the seed test it mirrors. Sizes, offsets and placements are the
seed's numbers; values are checked bit for bit against plain torch on the local
backend, where every rank's shards live in this process. The seed places shards on
``cuda:r``; layouts keep those strings, and arrays that hold data use ``cpu``.
"""

from __future__ import annotations

import re

import pytest
import torch

import fshard
from fshard import Chunk, Explicit, Layout, LayoutError, Mesh, Named, Replicated, Shard, ShardMeta, Single, SpecError

CUDA = ("rank:0/cuda:0", "rank:1/cuda:1", "rank:2/cuda:2", "rank:3/cuda:3")
CPU = ("rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu")


def _data(*shape: int) -> torch.Tensor:
    """Reproducible random values (a fresh generator, so no global RNG state is touched)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1234))


def _box(meta: ShardMeta) -> tuple[slice, ...]:
    """The index of ``meta``'s box in the global tensor."""
    return tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))


def _assert_holds(array: fshard.ShardedArray, x: torch.Tensor) -> None:
    """Every shard of ``array`` holds its box of ``x``, bit for bit, and gather gives ``x`` back."""
    assert array.shape == x.shape
    for s in array.addressable_shards:
        assert s.data.dtype == x.dtype
        assert torch.equal(s.data, x[_box(s.meta)]), s.meta
    assert torch.equal(fshard.gather(array), x)


def _placements(layout: Layout) -> list[str]:
    """The placement string of every shard, in layout order."""
    return [str(s.placement) for s in layout.shards]


# -- TestShardTensor -------------------------------------------------------------------------


def test_shard_tensor():
    x = _data(12, 12)
    st = fshard.shard(x, Chunk(0, CPU))
    assert isinstance(st, fshard.ShardedArray)
    for rank in range(4):
        (meta,) = st.layout.shards_on(rank)
        assert meta.sizes == (3, 12)
        (shard,) = [s for s in st.addressable_shards if s.meta == meta]
        assert torch.equal(shard.data, torch.narrow(x, 0, 3 * rank, 3))


def test_shard_tensor_with_empty_shard():
    x = _data(9, 12)
    st = fshard.shard(x, Chunk(0, CPU))
    metas = st.layout.shards
    assert len(metas) == 4
    assert all(m.offsets[0] + m.sizes[0] <= x.size(0) for m in metas)
    assert [s.data.shape for s in st.addressable_shards] == [torch.Size([3, 12])] * 3 + [torch.Size([0, 12])]
    for rank in range(3):
        assert torch.equal(st.addressable_shards[rank].data, torch.narrow(x, 0, 3 * rank, 3))
    _assert_holds(st, x)


def test_shard_tensor_reads_non_contiguous_input():
    x = _data(12, 12)
    st = fshard.shard(x.t(), Chunk(0, CPU))
    _assert_holds(st, x.t())
    assert all(s.data.is_contiguous() for s in st.addressable_shards)


def test_shard_tensor_from_one_source_rank():
    x = _data(12, 12)
    st = fshard.shard(x, Chunk(0, CPU), src=0)
    assert st.layout == fshard.shard(x, Chunk(0, CPU)).layout
    _assert_holds(st, x)


# -- TestLocalTensor -------------------------------------------------------------------------


def test_local_tensor():
    st = fshard.rand(Chunk(0, CPU), 24, 12, seed=0)
    assert [m.sizes for m in st.layout.shards] == [(6, 12)] * 4
    one = fshard.reshard(st, Chunk(0, ["rank:0/cpu"]))
    assert one.local_tensor().size() == torch.Size([24, 12])
    assert torch.equal(one.local_tensor(), fshard.gather(st))


def test_local_tensor_error():
    placements = ["rank:0/cpu"] * 2 + ["rank:1/cpu"] * 3 + ["rank:2/cpu"] * 3 + ["rank:3/cpu"] * 2
    st = fshard.rand(Chunk(0, placements), 24, 12, seed=0)
    assert [(m.offsets[0], m.sizes[0]) for m in st.layout.shards] == [(3 * i, 3) for i in range(8)] + [(24, 0), (27, 0)]
    assert [len(st.layout.shards_on(r)) for r in range(4)] == [2, 3, 3, 2]
    with pytest.raises(NotImplementedError, match=re.escape("Only single local shard is supported.")):
        st.local_tensor()


# -- TestShardedTensorChunked ----------------------------------------------------------------


def test_sharded_tensor_metadata():
    st = fshard.empty(Chunk(0, CPU), 10, 20)
    assert st.layout.shape == (10, 20)
    assert st.size() == torch.Size([10, 20])
    assert st.dtype == torch.float
    assert st.requires_grad is False
    assert fshard.empty(Chunk(0, CPU), 10, 20, requires_grad=True).requires_grad is True
    assert fshard.empty(Chunk(0, CPU), 10, 20, dtype=torch.double).dtype == torch.double
    # Read-only properties: the global metadata cannot change without its shards.
    with pytest.raises(AttributeError, match=re.escape("ShardedArray is immutable: cannot set 'requires_grad'")):
        st.requires_grad = True  # type: ignore[misc]


def test_sharded_tensor_metadata_matches_torch():
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    torch_meta = ChunkShardingSpec(0, list(CUDA)).build_metadata(torch.Size([10, 20]), TensorProperties())
    assert Chunk(0, CUDA).layout((10, 20)).to_torch_metadata() == torch_meta


def test_creation_device_moves_every_placement():
    st = fshard.empty(Chunk(0, CUDA), 10, 20, device="cpu")
    assert _placements(st.layout) == list(CPU)
    assert st.device == torch.device("cpu")


@pytest.mark.parametrize("dim", [0, -2])
def test_complete_world_size(dim):
    layout = Chunk(dim, CUDA).layout((10, 20))
    assert len(layout.shards) == 4
    for rank, meta in enumerate(layout.shards):
        assert meta.offsets == (rank * 3, 0)
        assert meta.sizes == ((1, 20) if rank == 3 else (3, 20))
        assert str(meta.placement) == f"rank:{rank}/cuda:{rank}"
    st = fshard.empty(Chunk(dim, CPU), 10, 20)
    assert [s.data.size() for s in st.addressable_shards] == [(3, 20), (3, 20), (3, 20), (1, 20)]
    assert all(s.data.device == torch.device("cpu") for s in st.addressable_shards)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda s: fshard.ones(s, 10, 20), torch.ones),
        (lambda s: fshard.zeros(s, 10, 20), torch.zeros),
        (
            lambda s: fshard.full(s, (10, 20), fill_value=1234, dtype=torch.int32),
            lambda *size: torch.full(size, 1234, dtype=torch.int32),
        ),
    ],
    ids=["ones", "zeros", "full"],
)
def test_create_sharded_tensor_with_constants(make, expected):
    st = make(Chunk(0, CPU))
    for rank, shard in enumerate(st.addressable_shards):
        expected_h = 1 if rank == 3 else 3  # ceil(10 / 4) except the last
        assert shard.data.size() == (expected_h, 20)
        assert shard.data.dtype == expected(1).dtype
        assert torch.equal(shard.data, expected(expected_h, 20))


@pytest.mark.parametrize("make", [fshard.rand, fshard.randn], ids=["rand", "randn"])
def test_create_sharded_tensor_with_rand(make):
    spec = Chunk(0, CPU)
    st = make(spec, 8, 2, seed=1234, dtype=torch.double)
    assert [s.data.size() for s in st.addressable_shards] == [(2, 2)] * 4
    assert st.dtype == torch.double
    full = fshard.gather(st)
    # fshard's random values depend on the seed and the global index only, not on the layout.
    for other in (Replicated([0]), Chunk(1, [0, 1]), Named(Mesh((2, 2)), ("x", "y")), Chunk(0, [3, 2, 1, 0, 3])):
        assert torch.equal(fshard.gather(make(other, 8, 2, seed=1234, dtype=torch.double)), full)
    assert not torch.equal(fshard.gather(make(spec, 8, 2, seed=1235, dtype=torch.double)), full)
    # seed=None draws from torch's generator, so torch.manual_seed makes it reproducible.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        a = make(spec, 8, 2)
        torch.manual_seed(1234)
        b = make(spec, 8, 2)
    assert torch.equal(fshard.gather(a), fshard.gather(b))


def test_rand_values_are_uniform_in_the_unit_interval():
    full = fshard.gather(fshard.rand(Chunk(0, CPU), 64, 64, seed=3))
    assert float(full.min()) >= 0.0
    assert float(full.max()) < 1.0


def test_gather_even():
    st = fshard.ones(Chunk(0, CPU), 10, 20)
    assert torch.equal(fshard.gather(st, dst=1), torch.ones(10, 20))
    assert torch.equal(fshard.gather(st), torch.ones(10, 20))


def test_gather_uneven():
    spec = Chunk(0, ["rank:0/cpu", "rank:0/cpu", "rank:1/cpu", "rank:1/cpu", "rank:2/cpu"])
    st = fshard.ones(spec, 10, 20)
    assert [m.sizes for m in st.layout.shards] == [(2, 20)] * 5
    assert torch.equal(fshard.gather(st, dst=1), torch.ones(10, 20))
    x = _data(10, 20)
    _assert_holds(fshard.shard(x, spec), x)


def test_create_sharded_tensor_like():
    spec = Chunk(0, CPU)
    st = fshard.rand(spec, (8, 8), dtype=torch.double, seed=1234)
    expected = {
        "zeros_like": torch.zeros(2, 8, dtype=torch.double),
        "ones_like": torch.ones(2, 8, dtype=torch.double),
    }
    for name, want in expected.items():
        new = getattr(fshard, name)(st, dtype=torch.double)
        assert new.layout == st.layout
        assert all(torch.equal(s.data, want) for s in new.addressable_shards)
    full = fshard.full_like(st, 8.8, dtype=torch.double)
    assert all(torch.equal(s.data, torch.full((2, 8), 8.8, dtype=torch.double)) for s in full.addressable_shards)
    empty = fshard.empty_like(st, dtype=torch.double)
    assert [s.data.shape for s in empty.addressable_shards] == [torch.Size([2, 8])] * 4
    assert empty.dtype == torch.double
    for like, make in ((fshard.rand_like, fshard.rand), (fshard.randn_like, fshard.randn)):
        new = like(st, seed=7)
        assert new.layout == st.layout
        assert new.dtype == torch.double
        assert torch.equal(fshard.gather(new), fshard.gather(make(Single(0), 8, 8, seed=7, dtype=torch.double)))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            a = like(st)
            torch.manual_seed(1234)
            b = like(st)
        assert torch.equal(fshard.gather(a), fshard.gather(b))


def test_like_functions_keep_or_override_dtype():
    st = fshard.zeros(Chunk(0, CPU), 8, 8, dtype=torch.double)
    assert fshard.ones_like(st).dtype == torch.double
    assert fshard.ones_like(st, dtype=torch.int32).dtype == torch.int32
    assert fshard.zeros_like(st, requires_grad=True).requires_grad is True


def test_partial_world_size():
    layout = Chunk(0, ["rank:2/cuda:2", "rank:3/cuda:3"]).layout((10, 20))
    assert len(layout.shards) == 2
    assert layout.ranks == (2, 3)
    assert layout.shards_on(0) == layout.shards_on(1) == ()
    for k, meta in enumerate(layout.shards):
        assert (meta.offsets, meta.sizes, str(meta.placement)) == ((k * 5, 0), (5, 20), f"rank:{k + 2}/cuda:{k + 2}")
    x = _data(10, 20)
    _assert_holds(fshard.shard(x, Chunk(0, ["rank:2/cpu", "rank:3/cpu"])), x)


def test_multiple_local_shards():
    layout = Chunk(0, CUDA + CUDA).layout((16, 20))
    assert len(layout.shards) == 8
    for idx, meta in enumerate(layout.shards):
        assert meta.offsets == (idx * 2, 0)
        assert meta.sizes == (2, 20)
        assert str(meta.placement) == f"rank:{idx % 4}/cuda:{idx % 4}"
    assert [len(layout.shards_on(r)) for r in range(4)] == [2, 2, 2, 2]
    st = fshard.empty(Chunk(0, CPU + CPU), 16, 20)
    with pytest.raises(NotImplementedError, match=re.escape("Only single local shard is supported.")):
        st.local_tensor()
    x = _data(16, 20)
    _assert_holds(fshard.shard(x, Chunk(0, CPU + CPU)), x)


@pytest.mark.parametrize("dim", [1, -1])
def test_sharding_columns(dim):
    layout = Chunk(dim, CUDA).layout((10, 32))
    assert len(layout.shards) == 4
    for rank, meta in enumerate(layout.shards):
        assert (meta.offsets, meta.sizes, str(meta.placement)) == ((0, rank * 8), (10, 8), f"rank:{rank}/cuda:{rank}")
    x = _data(10, 32)
    st = fshard.shard(x, Chunk(dim, CPU))
    assert [s.data.size() for s in st.addressable_shards] == [(10, 8)] * 4
    _assert_holds(st, x)


def test_insufficient_sharding_dims():
    layout = Chunk(0, CUDA).layout((2, 20))
    for rank, meta in enumerate(layout.shards):
        assert meta.offsets == (rank, 0)
        assert str(meta.placement) == f"rank:{rank}/cuda:{rank}"
        assert meta.sizes == ((1, 20) if rank <= 1 else (0, 20))
    st = fshard.empty(Chunk(0, CPU), 2, 20)
    assert [s.data.numel() for s in st.addressable_shards] == [20, 20, 0, 0]
    x = _data(2, 20)
    _assert_holds(fshard.shard(x, Chunk(0, CPU)), x)


def test_invalid_sharding():
    with pytest.raises(NotImplementedError, match="does not support named dimension"):
        fshard.empty(Chunk("H", ["rank:1/cuda:1"]), 10, 20)  # type: ignore[arg-type]
    for dim in [2, 3, 4, -3, -4, -5]:
        with pytest.raises(SpecError, match="Invalid sharding dim"):
            fshard.empty(Chunk(dim, ["rank:1/cuda:1"]), 10, 20)
    st = fshard.empty(Chunk(0, ["rank:0/cpu"]), 10, 20)
    with pytest.raises(TypeError, match=re.escape("torch.add is not supported for ShardedArray")):
        torch.add(st, torch.empty(10, 20))
    for worker in ("worker0/cuda:1", "workerfoo/cuda:1"):
        with pytest.raises(SpecError, match=re.escape("fshard has no RPC")):
            fshard.empty(Chunk(0, [worker]), 10, 20)


def test_sharded_tensor_sizes():
    spec = Chunk(0, CPU)
    assert fshard.empty(spec, 10, 20).size() == torch.Size([10, 20])
    assert fshard.empty(spec, 10).size() == torch.Size([10])
    assert fshard.empty(spec, [10, 20]).size() == torch.Size([10, 20])
    assert fshard.empty(spec, (10, 20)).size() == torch.Size([10, 20])
    assert fshard.empty(spec, torch.Size([10, 20])).size() == torch.Size([10, 20])
    st = fshard.empty(spec, (10, 20))
    assert (st.size(0), st.size(1), st.size(-1)) == (10, 20, 20)
    assert st.dim() == 2
    assert st.ndim == 2
    with pytest.raises(IndexError, match="Dimension out of range"):
        st.size(-3)
    with pytest.raises(IndexError, match="Dimension out of range"):
        st.size(2)
    with pytest.raises(TypeError):
        fshard.empty(spec, "foo")


MAKERS = {
    "empty": fshard.empty,
    "zeros": fshard.zeros,
    "ones": fshard.ones,
    "full": lambda spec, *size: fshard.full(spec, *size, fill_value=3),
    "rand": lambda spec, *size: fshard.rand(spec, *size, seed=0),
    "randn": lambda spec, *size: fshard.randn(spec, *size, seed=0),
}


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
@pytest.mark.parametrize(
    "size", [(10, 20), ([10, 20],), ((10, 20),), (torch.Size([10, 20]),)], ids=["ints", "list", "tuple", "torch-size"]
)
def test_creation_size_forms(make, size):
    st = make(Chunk(0, CPU), *size)
    assert st.size() == torch.Size([10, 20])
    assert [s.data.size() for s in st.addressable_shards] == [(3, 20), (3, 20), (3, 20), (1, 20)]


@pytest.mark.parametrize("bad", [("foo",), (10.0,), ([10, "20"],), ((10, None),), (True,)])
@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_creation_rejects_non_int_sizes(make, bad):
    with pytest.raises(TypeError, match="shape must hold ints"):
        make(Chunk(0, CPU), *bad)


# -- TestShardedTensorEnumerable -------------------------------------------------------------


def _grid(rows: int, cols: int, box: tuple[int, int], placements) -> Explicit:
    """A ``rows`` x ``cols`` grid of ``box``-sized boxes, row-major over ``placements``."""
    h, w = box
    cells = [(i, j) for i in range(rows) for j in range(cols)]
    return Explicit([((h * i, w * j), box, p) for (i, j), p in zip(cells, placements)])


def test_enumerable_sharded_tensor_metadata():
    spec = _grid(2, 2, (5, 5), CUDA)
    layout = spec.layout((10, 10))
    assert [(m.offsets, m.sizes, str(m.placement)) for m in layout.shards] == [
        ((0, 0), (5, 5), "rank:0/cuda:0"),
        ((0, 5), (5, 5), "rank:1/cuda:1"),
        ((5, 0), (5, 5), "rank:2/cuda:2"),
        ((5, 5), (5, 5), "rank:3/cuda:3"),
    ]
    st = fshard.empty(_grid(2, 2, (5, 5), CPU), 10, 10)
    assert st.size() == torch.Size([10, 10])
    assert (st.dtype, st.requires_grad) == (torch.float, False)
    assert fshard.empty(_grid(2, 2, (5, 5), CPU), 10, 10, requires_grad=True).requires_grad is True
    assert fshard.empty(_grid(2, 2, (5, 5), CPU), 10, 10, dtype=torch.double).dtype == torch.double


def test_grid_sharding():
    x = _data(10, 10)
    st = fshard.shard(x, _grid(2, 2, (5, 5), CPU))
    assert [s.data.size() for s in st.addressable_shards] == [(5, 5)] * 4
    _assert_holds(st, x)
    assert st.layout == Named(Mesh((2, 2)), ("x", "y")).layout((10, 10))


def test_five_by_five_grid_of_boxes():
    spec = _grid(5, 5, (2, 2), range(25))
    layout = spec.layout((10, 10))
    assert layout.ranks == tuple(range(25))
    assert [m.offsets for m in layout.shards] == [(2 * i, 2 * j) for i in range(5) for j in range(5)]
    x = _data(10, 10)
    st = fshard.shard(x, spec)
    assert [s.data.size() for s in st.addressable_shards] == [(2, 2)] * 25
    _assert_holds(st, x)
    assert layout == Named(Mesh((5, 5)), ("x", "y")).layout((10, 10))


def test_uneven_shards():
    spec = Explicit(
        [
            ((0, 0), (2, 4), "rank:0/cpu"),
            ((0, 4), (4, 2), "rank:1/cpu"),
            ((2, 0), (4, 4), "rank:2/cpu"),
            ((4, 4), (2, 2), "rank:3/cpu"),
        ]
    )
    x = _data(6, 6)
    st = fshard.shard(x, spec)
    sizes = {0: (2, 4), 1: (4, 2), 2: (4, 4), 3: (2, 2)}
    offsets = {0: (0, 0), 1: (0, 4), 2: (2, 0), 3: (4, 4)}
    for rank in range(4):
        (shard,) = [s for s in st.addressable_shards if s.meta.placement.rank == rank]
        assert tuple(shard.data.size()) == sizes[rank]
        assert shard.meta.offsets == offsets[rank]
    _assert_holds(st, x)


def test_enumerable_partial_world_size():
    spec = Explicit([((0, 0), (5, 5), "rank:2/cpu"), ((5, 0), (5, 5), "rank:3/cpu")])
    x = _data(10, 5)
    st = fshard.shard(x, spec)
    assert st.layout.ranks == (2, 3)
    assert st.layout.shards_on(0) == ()
    _assert_holds(st, x)


def test_enumerable_multiple_local_shards():
    spec = _grid(2, 2, (5, 5), ["rank:0/cpu", "rank:1/cpu", "rank:0/cpu", "rank:1/cpu"])
    x = _data(10, 10)
    st = fshard.shard(x, spec)
    assert [m.offsets for m in st.layout.shards_on(0)] == [(0, 0), (5, 0)]
    assert [m.offsets for m in st.layout.shards_on(1)] == [(0, 5), (5, 5)]
    with pytest.raises(NotImplementedError, match=re.escape("Only single local shard is supported.")):
        st.local_tensor()
    _assert_holds(st, x)


def test_enumerable_with_rpc_names():
    with pytest.raises(SpecError, match=re.escape("RPC worker names are not supported: fshard has no RPC")):
        Explicit([((0, 0), (5, 5), "worker0/cuda:0"), ((5, 0), (5, 5), "worker1/cuda:1")])


# -- TestShardedTensorFromLocalShards (the checks that need no second process) ---------------


def _seed_boxes(first: int) -> list[ShardMeta]:
    """The seed's four boxes of a 10 x 10 tensor, rank 0's box ``first`` x ``first``."""
    return [ShardMeta(((r // 2) * 5, (r % 2) * 5), (first, first) if r == 0 else (5, 5), r) for r in range(4)]


def test_init_from_local_shards_and_layout():
    x = _data(10, 10)
    layout = Layout((10, 10), _seed_boxes(5))
    shards = [Shard(m, x[_box(m)].clone()) for m in layout.shards]
    st = fshard.from_local_shards_and_layout(shards[::-1], layout)
    assert st.layout == layout
    _assert_holds(st, x)


def test_init_from_local_shards_invalid_shards_overlap():
    with pytest.raises(LayoutError, match="overlap"):
        Layout((10, 10), _seed_boxes(6))


def test_init_from_local_shards_invalid_shards_gaps():
    msg = "Shards do not cover element (0, 4) of shape (10, 10) (the distinct boxes hold 91 of 100 elements)"
    with pytest.raises(LayoutError, match=re.escape(msg)):
        Layout((10, 10), _seed_boxes(4))


def test_init_from_local_shards_wrong_shard_size():
    meta = ShardMeta((0, 0), (5, 5), 0)
    with pytest.raises(LayoutError, match=re.escape("Shard data has shape (4, 5) but its box has sizes (5, 5).")):
        Shard(meta, torch.zeros(4, 5))


# -- reshard and map_local over the seed's layouts -------------------------------------------

SEED_LAYOUTS = {
    "rows": Chunk(0, CPU),
    "columns": Chunk(-1, CPU),
    "rows-2-per-rank": Chunk(0, CPU + CPU),
    "partial-world": Chunk(0, CPU[2:]),
    "rows-repeated": Chunk(0, [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]),
    "grid-5x5-boxes": _grid(2, 2, (5, 5), CPU),
    "grid-of-25": _grid(5, 5, (2, 2), range(25)),
    "replicated": Replicated(range(4)),
    "rows-replicas": Named(Mesh((2, 2)), ("x", None)),
    "single": Single(3),
}


@pytest.mark.parametrize("src", SEED_LAYOUTS.values(), ids=SEED_LAYOUTS.keys())
def test_reshard_between_seed_layouts(src):
    x = _data(10, 10)
    a = fshard.shard(x, src)
    for dst in SEED_LAYOUTS.values():
        b = fshard.reshard(a, dst)
        assert b.layout == dst.layout((10, 10))
        _assert_holds(b, x)
    _assert_holds(a, x)  # the input is unchanged


def test_reshard_to_the_same_layout_returns_the_input():
    a = fshard.shard(_data(10, 10), Chunk(0, CPU))
    assert fshard.reshard(a, Chunk(0, CPU)) is a
    assert fshard.reshard(a, a.layout) is a


def test_map_local_elementwise():
    x = _data(10, 20)
    a = fshard.shard(x, Chunk(0, CPU))
    b = fshard.map_local(lambda t: t * 2 + 1, a)
    assert b.layout == a.layout
    _assert_holds(b, x * 2 + 1)
    _assert_holds(a, x)


def test_map_local_of_two_arrays():
    x, y = _data(10, 20), torch.arange(200.0).reshape(10, 20)
    a, b = fshard.shard(x, Chunk(1, CPU)), fshard.shard(y, Chunk(1, CPU))
    _assert_holds(fshard.map_local(torch.mul, a, b), x * y)


def test_map_local_infers_the_new_extent_of_an_unsplit_dim():
    x = _data(10, 20)
    a = fshard.shard(x, Chunk(0, CPU))
    b = fshard.map_local(lambda t: t[:, :5], a)
    assert b.layout == Chunk(0, CPU).layout((10, 5))
    _assert_holds(b, x[:, :5])
    c = fshard.map_local(lambda t: torch.cat([t, t], dim=1), a)
    _assert_holds(c, torch.cat([x, x], dim=1))


def test_map_local_with_out_spec_for_a_split_dim():
    x = _data(12, 3)
    a = fshard.shard(x, Chunk(0, CPU))
    b = fshard.map_local(lambda t: t[:1], a, out_spec=Chunk(0, CPU))
    assert b.layout == Chunk(0, CPU).layout((4, 3))
    _assert_holds(b, x[::3])


def test_map_local_changes_dtype():
    x = _data(10, 20)
    a = fshard.shard(x, Chunk(0, CPU))
    b = fshard.map_local(lambda t: t.to(torch.float64), a)
    assert b.dtype == torch.float64
    _assert_holds(b, x.double())


def test_equal_and_allclose_across_layouts():
    x = _data(10, 10)
    a, b = fshard.shard(x, Chunk(0, CPU)), fshard.shard(x, _grid(5, 5, (2, 2), range(25)))
    assert fshard.equal(a, b)
    assert fshard.allclose(a, fshard.map_local(lambda t: t + 1e-9, b))
    assert not fshard.equal(a, fshard.map_local(lambda t: t + 1, b))
    assert not fshard.equal(a, fshard.shard(x[:5], Chunk(0, CPU)))
