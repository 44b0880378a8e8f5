"""Sharding specs and how they resolve to layouts (DESIGN.md section 2).

``Chunk`` must equal torch's ``ChunkShardingSpec`` box for box; ``Named`` follows JAX's
``NamedSharding`` with uneven dims split like ``torch.chunk``; ``Replicated``, ``Single``
and ``Explicit`` give the boxes they describe.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from fshard import (
    Chunk,
    Explicit,
    Layout,
    LayoutError,
    Mesh,
    Named,
    Partial,
    Placement,
    Replicated,
    ShardMeta,
    Single,
    SpecError,
)
from fshard._layout.specs import as_layout


def _boxes(layout: Layout) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(offsets, sizes, rank) of every shard, in layout order."""
    return [(s.offsets, s.sizes, s.placement.rank) for s in layout.shards]


def _dim_boxes(layout: Layout, dim: int) -> list[tuple[int, int]]:
    """(offset, size) along ``dim`` of every shard, in layout order."""
    return [(s.offsets[dim], s.sizes[dim]) for s in layout.shards]


# -- Chunk ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "k", "expected"),
    [
        (10, 4, [(0, 3), (3, 3), (6, 3), (9, 1)]),
        (12, 4, [(0, 3), (3, 3), (6, 3), (9, 3)]),
        (9, 4, [(0, 3), (3, 3), (6, 3), (9, 0)]),
        (2, 4, [(0, 1), (1, 1), (2, 0), (3, 0)]),
        (32, 4, [(0, 8), (8, 8), (16, 8), (24, 8)]),
        (10, 2, [(0, 5), (5, 5)]),
        (16, 8, [(2 * i, 2) for i in range(8)]),
        (10, 5, [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2)]),
        (24, 10, [(0, 3), (3, 3), (6, 3), (9, 3), (12, 3), (15, 3), (18, 3), (21, 3), (24, 0), (27, 0)]),
        (5, 3, [(0, 2), (2, 2), (4, 1)]),
        (7, 1, [(0, 7)]),
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (1, 3, [(0, 1), (1, 0), (2, 0)]),
    ],
)
def test_chunk_offsets_and_sizes(n, k, expected):
    lay = Chunk(0, range(k)).layout((n, 6))
    assert _dim_boxes(lay, 0) == expected
    assert [s.sizes[1] for s in lay.shards] == [6] * k
    assert [s.offsets[1] for s in lay.shards] == [0] * k
    assert [s.placement for s in lay.shards] == [Placement(r) for r in range(k)]


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_chunk_on_each_dim_of_a_3d_shape(dim):
    shape = (5, 7, 9)
    lay = Chunk(dim, [0, 1, 2]).layout(shape)
    step = -(-shape[dim] // 3)
    for i, s in enumerate(lay.shards):
        assert s.offsets == tuple(i * step if d == dim else 0 for d in range(3))
        assert s.sizes == tuple(min(step, shape[d] - i * step) if d == dim else shape[d] for d in range(3))


@pytest.mark.parametrize(
    ("dim", "shape", "positive"),
    [(-1, (10, 32), 1), (-2, (10, 32), 0), (-3, (3, 10, 32), 0), (-1, (7,), 0)],
)
def test_chunk_negative_dim_counts_from_the_end(dim, shape, positive):
    assert Chunk(dim, [0, 1, 2, 3]).layout(shape) == Chunk(positive, [0, 1, 2, 3]).layout(shape)


def _torch_chunk_boxes(shape: tuple[int, ...], dim: int, k: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes of torch's ``ChunkShardingSpec.build_metadata`` for ``k`` placements."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in range(k)])
    meta = spec.build_metadata(torch.Size(shape), TensorProperties())
    return [(tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in meta.shards_metadata]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_chunk_equals_torch_chunk_sharding_spec(k):
    for n, dim in itertools.product(range(12), (0, 1, -1)):
        shape = (n, 3) if dim == 0 else (3, n)
        lay = Chunk(dim, range(k)).layout(shape)
        assert [(s.offsets, s.sizes) for s in lay.shards] == _torch_chunk_boxes(shape, dim, k), (shape, dim)


def test_chunk_accepts_one_placement_without_a_list():
    assert Chunk(0, "rank:1/cuda:1").placements == (Placement(1, "cuda:1"),)
    assert Chunk(0, 3).placements == (Placement(3),)


def test_numpy_ints_are_ranks_as_ints_are():
    """As Mesh(ranks=np.arange(4)) and gather(dst=np.int64(1)) take them; Chunk(0, np.arange(4)) raised."""
    assert Chunk(0, np.arange(4)) == Chunk(0, [0, 1, 2, 3])
    assert Replicated([np.int32(0), np.int32(1)]) == Replicated([0, 1])
    assert Single(np.int64(1)) == Single(1)
    assert Chunk(np.int64(-1), [0, 1]) == Chunk(-1, [0, 1])  # a dim too
    with pytest.raises(SpecError, match=re.escape("Cannot read 1.0 (float) as a placement")):
        Chunk(0, [0, 1.0])


def test_chunk_repeated_placements_give_several_shards_per_rank():
    lay = Chunk(0, [0, 1, 0, 1]).layout((8,))
    assert _boxes(lay) == [((0,), (2,), 0), ((2,), (2,), 1), ((4,), (2,), 0), ((6,), (2,), 1)]


def test_chunk_is_a_hashable_value():
    a = Chunk(0, [0, "rank:1/cpu"])
    assert a == Chunk(0, (Placement(0), Placement(1)))
    assert hash(a) == hash(Chunk(0, (Placement(0), Placement(1))))
    assert a != Chunk(1, [0, 1])


def test_chunk_named_dim_is_not_supported():
    with pytest.raises(NotImplementedError, match="does not support named dimension"):
        Chunk("H", ["rank:1/cuda:1"])  # type: ignore[arg-type]


@pytest.mark.parametrize("dim", [2, 3, 4, -3, -4, -5])
def test_chunk_dim_out_of_range(dim):
    msg = f"Invalid sharding dim: {dim} for a 2-D array (valid: -2 to 1)."
    with pytest.raises(SpecError, match=re.escape(msg)):
        Chunk(dim, ["rank:1/cuda:1"]).layout((10, 20))


def test_chunk_of_a_scalar_has_no_dim():
    msg = "Invalid sharding dim: 0 for a 0-D array (it has no dim to split; use Replicated or Single)."
    with pytest.raises(SpecError, match=re.escape(msg)):
        Chunk(0, [0]).layout(())


# -- Mesh -------------------------------------------------------------------------------------


def test_mesh_defaults():
    m = Mesh((2, 3))
    assert m.shape == (2, 3)
    assert m.ranks == tuple(Placement(r) for r in range(6))
    assert m.axis_names == ("x", "y")
    assert Mesh((2,)).axis_names == ("x",)
    assert Mesh((1, 1, 1, 1, 1)).axis_names == ("x", "y", "z", "axis3", "axis4")
    assert (m.axis("x"), m.axis("y")) == (0, 1)


def test_mesh_reads_nested_ranks_row_major():
    m = Mesh((2, 2), ranks=[[3, "rank:2/cuda:2"], [1, Placement(0)]], axis_names=["dp", "tp"])
    assert m.ranks == (Placement(3), Placement(2, "cuda:2"), Placement(1), Placement(0))
    assert m.axis_names == ("dp", "tp")


def test_mesh_is_a_hashable_value():
    assert Mesh((2, 2)) == Mesh([2, 2], ranks=range(4), axis_names=("x", "y"))
    assert hash(Mesh((2, 2))) == hash(Mesh([2, 2], ranks=range(4), axis_names=("x", "y")))
    assert Mesh((2, 2)) != Mesh((2, 2), ranks=[3, 2, 1, 0])


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"shape": (2, 2), "ranks": [0, 1, 2]}, "Mesh of shape (2, 2) needs 4 placements, got 3."),
        ({"shape": (3,), "ranks": [0, 1, 2, 3]}, "Mesh of shape (3,) needs 3 placements, got 4."),
        (
            {"shape": (2, 2), "ranks": [0, 1, 1, 2]},
            "Mesh placements must be distinct, got ['rank:0/cpu', 'rank:1/cpu', 'rank:1/cpu', 'rank:2/cpu'].",
        ),
        ({"shape": (2, 2), "axis_names": ("a",)}, "Mesh of shape (2, 2) needs 2 distinct axis names, got ('a',)."),
        (
            {"shape": (2, 2), "axis_names": ("a", "a")},
            "Mesh of shape (2, 2) needs 2 distinct axis names, got ('a', 'a').",
        ),
        ({"shape": (2,), "ranks": "ab"}, "got the string 'ab': give a list, e.g. ranks=[0, 1] or ranks=['rank:0/cpu'"),
    ],
    ids=["too-few-ranks", "too-many-ranks", "repeated-rank", "too-few-names", "repeated-name", "a-string"],
)
def test_mesh_errors(kwargs, msg):
    with pytest.raises(SpecError, match=re.escape(msg)):
        Mesh(**kwargs)


# -- Named ------------------------------------------------------------------------------------


def test_named_grid():
    lay = Named(Mesh((2, 2)), ("x", "y")).layout((4, 6))
    assert _boxes(lay) == [
        ((0, 0), (2, 3), 0),
        ((0, 3), (2, 3), 1),
        ((2, 0), (2, 3), 2),
        ((2, 3), (2, 3), 3),
    ]


def test_named_grid_transposed_partition():
    lay = Named(Mesh((2, 2)), ("y", "x")).layout((4, 6))
    assert _boxes(lay) == [
        ((0, 0), (2, 3), 0),
        ((2, 0), (2, 3), 1),
        ((0, 3), (2, 3), 2),
        ((2, 3), (2, 3), 3),
    ]


def test_named_mesh_with_custom_ranks_and_names():
    mesh = Mesh((2, 3), ranks=[[5, 4, 3], [2, 1, 0]], axis_names=("dp", "tp"))
    lay = Named(mesh, ("tp", "dp")).layout((6, 4))
    assert _boxes(lay) == [
        ((0, 0), (2, 2), 5),
        ((2, 0), (2, 2), 4),
        ((4, 0), (2, 2), 3),
        ((0, 2), (2, 2), 2),
        ((2, 2), (2, 2), 1),
        ((4, 2), (2, 2), 0),
    ]


@pytest.mark.parametrize(
    ("axes", "offsets"),
    [(("x", "y"), [0, 2, 4, 6]), (("y", "x"), [0, 4, 2, 6])],
    ids=["x-outer", "y-outer"],
)
def test_named_tuple_of_axes_splits_one_dim_over_their_product(axes, offsets):
    lay = Named(Mesh((2, 2)), (axes, None)).layout((8, 3))
    assert _boxes(lay) == [((o, 0), (2, 3), r) for r, o in enumerate(offsets)]


def test_named_unused_mesh_axes_hold_replicas():
    lay = Named(Mesh((2, 2)), ("x",)).layout((4, 3))
    assert _boxes(lay) == [((0, 0), (2, 3), 0), ((0, 0), (2, 3), 1), ((2, 0), (2, 3), 2), ((2, 0), (2, 3), 3)]
    cols = Named(Mesh((2, 2)), (None, "y")).layout((2, 5))
    assert _boxes(cols) == [((0, 0), (2, 3), 0), ((0, 3), (2, 2), 1), ((0, 0), (2, 3), 2), ((0, 3), (2, 2), 3)]


def test_named_with_no_split_axis_is_fully_replicated():
    lay = Named(Mesh((2, 2)), ()).layout((2, 2))
    assert lay.is_fully_replicated
    assert lay.ranks == (0, 1, 2, 3)


@pytest.mark.parametrize("n", range(10))
@pytest.mark.parametrize("k", [2, 3, 4])
def test_named_uneven_split_follows_torch_chunk(n, k):
    lay = Named(Mesh((k,)), ("x",)).layout((n,))
    chunks = torch.arange(n).chunk(k) if n else ()
    sizes = [len(c) for c in chunks] + [0] * (k - len(chunks))
    assert [s.sizes[0] for s in lay.shards] == sizes
    nonempty = [s.offsets[0] for s in lay.shards if s.sizes[0]]
    assert nonempty == [int(c[0]) for c in chunks]


def test_named_uneven_examples():
    assert _dim_boxes(Named(Mesh((2, 2)), ("x",)).layout((5, 3)), 0) == [(0, 3), (0, 3), (3, 2), (3, 2)]
    assert _dim_boxes(Named(Mesh((4,)), ("x",)).layout((2,)), 0) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    # Nested torch.chunk, the outer axis first: 5 -> 3, 2 over x, then each over y.
    assert _dim_boxes(Named(Mesh((2, 2)), (("x", "y"),)).layout((5, 3)), 0) == [(0, 2), (2, 1), (3, 1), (4, 1)]


def test_named_partition_entries_are_normalised():
    a = Named(Mesh((2, 2)), ["x", ["y"]])
    assert a.partition == ("x", ("y",))
    assert a == Named(Mesh((2, 2)), ("x", ("y",)))
    assert hash(a) == hash(Named(Mesh((2, 2)), ("x", ("y",))))


def test_named_shorter_partition_leaves_trailing_dims_whole():
    assert Named(Mesh((2,)), ("x",)).layout((4, 5, 6)) == Chunk(0, [0, 1]).layout((4, 5, 6))


@pytest.mark.parametrize(
    ("make", "msg"),
    [
        (lambda: Named(Mesh((2, 2)), ("z",)), "Mesh has no axis 'z'; its axes are ('x', 'y')."),
        (lambda: Named(Mesh((2, 2)), (("x", "q"),)), "Mesh has no axis 'q'; its axes are ('x', 'y')."),
        (
            lambda: Named(Mesh((2, 2)), ("x", "x")),
            "Partition ('x', 'x') uses a mesh axis twice; each axis may split one dim.",
        ),
        (
            lambda: Named(Mesh((2, 2)), (("x", "y"), "y")),
            "Partition (('x', 'y'), 'y') uses a mesh axis twice; each axis may split one dim.",
        ),
        (
            lambda: Named(Mesh((2, 2)), ("x", None, "y")).layout((4, 4)),
            "Partition ('x', None, 'y') has 3 entries for a 2-D array.",
        ),
        (
            lambda: Named(Mesh((2, 2)), (0,)),
            "Partition entry 0 must be a mesh axis name, a tuple of axis names, or None.",
        ),
        (lambda: Named((2, 2), ("x",)), "Named needs a Mesh, got tuple."),
    ],
    ids=[
        "unknown-axis",
        "unknown-axis-in-tuple",
        "axis-twice",
        "axis-twice-in-tuple",
        "too-many-entries",
        "bad-entry",
        "not-a-mesh",
    ],
)
def test_named_errors(make, msg):
    with pytest.raises(SpecError, match=re.escape(msg)):
        make()


# -- Replicated, Single, Explicit -------------------------------------------------------------


def test_replicated():
    lay = Replicated([0, "rank:1/cuda:1", 2]).layout((3, 4))
    assert [(s.offsets, s.sizes, str(s.placement)) for s in lay.shards] == [
        ((0, 0), (3, 4), "rank:0/cpu"),
        ((0, 0), (3, 4), "rank:1/cuda:1"),
        ((0, 0), (3, 4), "rank:2/cpu"),
    ]
    assert lay.is_fully_replicated
    assert Replicated(1).placements == (Placement(1),)


def test_single():
    lay = Single("rank:2/cpu").layout((2, 3))
    assert _boxes(lay) == [((0, 0), (2, 3), 2)]
    assert lay == Replicated([2]).layout((2, 3))
    assert Single(5).layout(()) == Layout((), [ShardMeta((), (), 5)])


def test_explicit_grid():
    spec = Explicit([((0, 0), (5, 5), 0), ((0, 5), (5, 5), 1), ((5, 0), (5, 5), 2), ((5, 5), (5, 5), 3)])
    assert spec.shards[1] == ShardMeta((0, 5), (5, 5), 1)
    assert spec.layout((10, 10)) == Named(Mesh((2, 2)), ("x", "y")).layout((10, 10))


def test_explicit_is_validated_against_the_shape():
    spec = Explicit([ShardMeta((0,), (2,), 0), ShardMeta((2,), (2,), 1)])
    assert spec.layout((4,)).ranks == (0, 1)
    msg = "Shards do not cover element (4,) of shape (5,) (the distinct boxes hold 4 of 5 elements)"
    with pytest.raises(LayoutError, match=re.escape(msg)):
        spec.layout((5,))
    msg = "Shard 1 [offsets (2,), sizes (2,)] on rank:1/cpu extends past shape (3,) in dim 0 (2 + 2 > 3)"
    with pytest.raises(LayoutError, match=re.escape(msg)):
        spec.layout((3,))


@pytest.mark.parametrize(
    ("make", "msg"),
    [
        (lambda: Replicated([]), "Replicated needs at least one placement, got none."),
        (lambda: Chunk(0, []), "Chunk needs at least one placement, got none."),
        (
            lambda: Single([0]),
            "Cannot read [0] (list) as a placement: give a Placement, a string like 'rank:0/cuda:0', or an int rank.",
        ),
    ],
    ids=["replicated-empty", "chunk-empty", "single-list"],
)
def test_placement_list_errors(make, msg):
    with pytest.raises(SpecError, match=re.escape(msg)):
        make()


# -- as_layout --------------------------------------------------------------------------------


def test_as_layout_resolves_specs_and_passes_layouts_through():
    lay = Chunk(0, [0, 1]).layout((4, 2))
    assert as_layout(lay, (4, 2)) is lay
    assert as_layout(lay, [4, 2]) is lay
    assert as_layout(Chunk(0, [0, 1]), (4, 2)) == lay


def test_as_layout_with_a_layout_of_another_shape():
    lay = Chunk(0, [0, 1]).layout((4, 2))
    with pytest.raises(SpecError, match=re.escape("Layout has shape (4, 2) but the array has shape (2, 4).")):
        as_layout(lay, (2, 4))


def test_as_layout_of_something_else():
    msg = "Expected a spec (Chunk, Named, Replicated, Single, Explicit, Partial) or a Layout, got 'rows'."
    with pytest.raises(SpecError, match=re.escape(msg)):
        as_layout("rows", (4,))


class _RowsOf2:
    """A user-defined spec: rows in blocks of 2 on ranks 0, 1, ...; unhashable (``__eq__`` without ``__hash__``)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _RowsOf2)

    def layout(self, shape: tuple[int, ...]) -> Layout:
        starts = range(0, shape[0], 2)
        return Layout(shape, [((r, 0), (min(2, shape[0] - r), shape[1]), k) for k, r in enumerate(starts)])


def test_any_object_with_a_layout_method_is_a_spec_even_unhashable():
    assert _RowsOf2.__hash__ is None
    assert _boxes(as_layout(_RowsOf2(), (5, 3))) == [((0, 0), (2, 3), 0), ((2, 0), (2, 3), 1), ((4, 0), (1, 3), 2)]


def test_resolving_a_spec_twice_gives_the_same_layout_value():
    spec = Named(Mesh((2, 2)), ("x", None))
    assert as_layout(spec, (4, 4)) is as_layout(Named(Mesh((2, 2)), ("x", None)), (4, 4))


def _specs() -> list[object]:
    mesh = Mesh((2, 2))
    return [
        Chunk(0, [0, 1, 2, 3]),
        Replicated(["rank:0/cpu", "rank:1/cpu"]),
        Single(2),
        Explicit([((0,), (3,), 0), ((3,), (1,), 1)]),
        mesh,
        Named(mesh, ("x", None)),
        Partial(Named(mesh, (None,)), over="y"),
        Partial(Replicated([0, 1]).layout((3,))),
    ]


def _hashes_of_pickled(blob: bytes) -> list[bool]:
    """Whether each pickled spec hashes as a fresh, equal one does in this process."""
    import pickle

    return [hash(s) == hash(f) and s == f for s, f in zip(pickle.loads(blob), _specs())]


def test_a_spec_keeps_its_hash_and_a_pickle_carries_none():
    # A spec of thousands of placements keys caches at every call: its hash is made once and kept. A pickle
    # carries the fields only, so another process (a pool's worker) hashes it as its own equal specs.
    import copy
    import pickle
    import subprocess
    import sys

    for spec, again in zip(_specs(), _specs()):
        assert spec == again
        assert hash(spec) == hash(again)
        assert spec._hash == hash(spec)  # kept
        assert pickle.loads(pickle.dumps(spec))._hash == 0  # made afresh where it is unpickled
        for copied in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec), copy.copy(spec)):
            assert copied == spec
            assert hash(copied) == hash(spec)
    assert hash(Chunk(0, [0, 1])) != hash(Chunk(1, [0, 1]))
    blob = pickle.dumps(_specs())
    code = f"import tests.test_specs as t; print(t._hashes_of_pickled({blob!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert other.stdout.strip() == str([True] * len(_specs()))


def test_equal_specs_hash_alike_whatever_the_types_of_their_values():
    import numpy as np

    class Rank(int):
        pass

    assert hash(Mesh((2,), axis_names=(np.str_("x"),))) == hash(Mesh((2,), axis_names=("x",)))
    assert hash(Chunk(0, [Rank(0), Rank(1)])) == hash(Chunk(0, [0, 1]))


def test_partial_of_an_unhashable_spec_is_unhashable_and_still_resolves():
    spec = Partial(_RowsOf2())
    with pytest.raises(TypeError, match="unhashable"):
        hash(spec)
    assert as_layout(spec, (3, 1)).partial == "sum"


def test_torch_metadata_edges() -> None:
    """The shape of a list of ShardMetadata ignores an empty box past the end (torch's own chunks put one there);
    a pending reduction has no torch metadata (its summands read back as replicas of one value)."""
    chunks = Chunk(0, [0, 1, 2, 3]).layout((5,))
    listed = chunks.to_torch_metadata().shards_metadata
    assert [s.shard_offsets for s in listed] == [[0], [2], [4], [6]]
    assert Layout.from_torch_metadata(listed) == chunks
    with pytest.raises(LayoutError, match=re.escape("cannot hold a pending reduction ('sum')")):
        Partial(Replicated([0, 1])).layout((3,)).to_torch_metadata()


def test_plan_queries_refuse_what_they_cannot_answer() -> None:
    from fshard import plan

    far = plan(Single(0).layout((3,)), Single(100_000).layout((3,)))
    with pytest.raises(SpecError, match=re.escape("ranks go up to 100000: 100001**2 numbers")):
        far.traffic()
    assert far.elements_sent == 3
    for bad in ("4", -4, 2.5, True):
        with pytest.raises(SpecError, match="a positive int"):
            far.bytes_sent(bad)
    assert far.bytes_sent(np.int64(4)) == 12
    with pytest.raises(SpecError, match=re.escape("must be below 2**63 - 1")):
        Placement(2**63 - 1)
    edge = Single(2**63 - 2).layout((3,))
    assert len(edge.shards_on(2**63 - 2)) == 1
