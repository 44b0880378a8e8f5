"""Bad input across the public API, and the exact error each one raises.

One table: every row is a call, the error type it must raise and its whole message.
Messages name the offending value and say what would be valid (DESIGN.md section 3).
"""

from __future__ import annotations

import re

import numpy as np
import optree
import pytest
import torch

import fshard
from fshard import (
    CheckpointError,
    Chunk,
    CollectiveMismatchError,
    Explicit,
    FShardError,
    Layout,
    LayoutError,
    Mesh,
    Named,
    Placement,
    Shard,
    ShardedArray,
    ShardMeta,
    SpecError,
)
from fshard.backends.local import LOCAL

ROWS = fshard.shard(torch.arange(200.0).reshape(10, 20), Chunk(0, [0, 1, 2, 3]))
COLS = fshard.shard(torch.arange(200.0).reshape(10, 20), Chunk(1, [0, 1, 2, 3]))
HALVES = Chunk(0, [0, 1]).layout((4,))
PARTS = tuple(Shard(m, torch.zeros(m.sizes)) for m in HALVES.shards)
EXTRA = Shard(ShardMeta((0,), (4,), 2), torch.zeros(4))

RPC_HINT = (
    " RPC worker names are not supported: fshard has no RPC; remote shards are reached with gather() or reshard()."
)
PLACEMENT_KINDS = "give a Placement, a string like 'rank:0/cuda:0', or an int rank."
N_CUDA = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torch_metadata_with_worker_name():
    """torch ``ShardedTensorMetadata`` whose one shard is placed on an RPC worker."""
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharding_spec import ShardMetadata

    return ShardedTensorMetadata([ShardMetadata([0], [4], "worker0/cuda:1")], torch.Size([4]), TensorProperties())


def _unflatten_with(array: ShardedArray, fn):
    """Rebuilds ``array`` through optree with ``fn`` applied to each shard tensor."""
    leaves, treespec = optree.tree_flatten(array)
    return optree.tree_unflatten(treespec, [fn(t) for t in leaves])


CASES = [
    # -- placements
    pytest.param(
        lambda: Placement.parse("worker0/cuda:1"),
        SpecError,
        "Invalid placement 'worker0/cuda:1': expected 'rank:<int>/<device>'." + RPC_HINT,
        id="placement-worker-name",
    ),
    pytest.param(
        lambda: Chunk(0, ["workerfoo/cuda:1"]),
        SpecError,
        "Invalid placement 'workerfoo/cuda:1': expected 'rank:<int>/<device>'." + RPC_HINT,
        id="placement-worker-name-in-spec",
    ),
    pytest.param(
        lambda: Placement.parse("rank:x/cpu"),
        SpecError,
        "Invalid placement 'rank:x/cpu': expected 'rank:<int>/<device>'.",
        id="placement-rank-not-a-number",
    ),
    pytest.param(
        lambda: Placement.parse("rank:0/"),
        SpecError,
        "Invalid placement 'rank:0/': expected 'rank:<int>/<device>'.",
        id="placement-empty-device",
    ),
    pytest.param(
        lambda: Placement.parse(3),  # type: ignore[arg-type]
        SpecError,
        "Invalid placement 3: expected 'rank:<int>/<device>'.",
        id="placement-parse-not-a-string",
    ),
    pytest.param(
        lambda: Placement(0, "foo"),
        SpecError,
        "Placement device 'foo' is not a torch device string such as 'cuda:0'.",
        id="placement-unknown-device",
    ),
    pytest.param(
        lambda: Placement.parse("rank:0/bogus:1"),
        SpecError,
        "Placement device 'bogus:1' is not a torch device string such as 'cuda:0'.",
        id="placement-unknown-device-in-string",
    ),
    pytest.param(
        lambda: Placement(0, 1),  # type: ignore[arg-type]
        SpecError,
        "Placement device must be a str such as 'cpu', got 1.",
        id="placement-device-not-a-string",
    ),
    pytest.param(
        lambda: Chunk(0, [1.5]),  # type: ignore[list-item]
        SpecError,
        "Cannot read 1.5 (float) as a placement: " + PLACEMENT_KINDS,
        id="placement-float",
    ),
    pytest.param(
        lambda: Placement(True),
        SpecError,
        "Placement rank must be a non-negative int, got True.",
        id="placement-bool-rank",
    ),
    # -- negative ranks
    pytest.param(
        lambda: Placement(-1),
        SpecError,
        "Placement rank must be a non-negative int, got -1.",
        id="negative-rank",
    ),
    pytest.param(
        lambda: Chunk(0, [0, -2]),
        SpecError,
        "Placement rank must be a non-negative int, got -2.",
        id="negative-rank-in-spec",
    ),
    pytest.param(
        lambda: Placement.parse("rank:-1/cpu"),
        SpecError,
        "Invalid placement 'rank:-1/cpu': expected 'rank:<int>/<device>'.",
        id="negative-rank-in-string",
    ),
    pytest.param(
        lambda: Mesh((2,), ranks=[0, -1]),
        SpecError,
        "Placement rank must be a non-negative int, got -1.",
        id="negative-rank-in-mesh",
    ),
    # -- shapes
    pytest.param(
        lambda: fshard.zeros(Chunk(0, [0]), "foo"),
        TypeError,
        "shape must hold ints, got 'foo' (str) in ('foo',).",
        id="shape-str",
    ),
    pytest.param(
        lambda: fshard.ones(Chunk(0, [0]), 2.0),
        TypeError,
        "shape must hold ints, got 2.0 (float) in (2.0,).",
        id="shape-float",
    ),
    pytest.param(
        lambda: fshard.empty(Chunk(0, [0]), [2, "a"]),
        TypeError,
        "shape must hold ints, got 'a' (str) in (2, 'a').",
        id="shape-list-with-str",
    ),
    pytest.param(
        lambda: fshard.full(Chunk(0, [0]), True, fill_value=1),
        TypeError,
        "shape must hold ints, got True (bool) in (True,).",
        id="shape-bool",
    ),
    pytest.param(
        lambda: fshard.zeros(Chunk(0, [0]), 3, -1),
        LayoutError,
        "shape must be non-negative, got (3, -1).",
        id="shape-negative",
    ),
    pytest.param(
        lambda: Layout(("a",), ()),
        TypeError,
        "shape must hold ints, got 'a' (str) in ('a',).",
        id="layout-shape-str",
    ),
    pytest.param(
        lambda: Chunk(0, [0]).layout((2.5,)),
        TypeError,
        "shape must hold ints, got 2.5 (float) in (2.5,).",
        id="spec-shape-float",
    ),
    pytest.param(
        lambda: Mesh((2, -1)),
        LayoutError,
        "Mesh shape must be non-negative, got (2, -1).",
        id="mesh-shape-negative",
    ),
    # -- shard metadata
    pytest.param(
        lambda: ShardMeta((0.5,), (1,), 0),
        TypeError,
        "ShardMeta offsets must hold ints, got 0.5 (float) in (0.5,).",
        id="meta-offset-float",
    ),
    pytest.param(
        lambda: ShardMeta((-1,), (1,), 0),
        LayoutError,
        "ShardMeta offsets must be non-negative, got (-1,).",
        id="meta-offset-negative",
    ),
    pytest.param(
        lambda: ShardMeta((0,), (-2,), 0),
        LayoutError,
        "ShardMeta sizes must be non-negative, got (-2,).",
        id="meta-size-negative",
    ),
    pytest.param(
        lambda: ShardMeta((0,), (1, 2), 0),
        LayoutError,
        "ShardMeta offsets (0,) and sizes (1, 2) have different lengths.",
        id="meta-lengths-differ",
    ),
    # -- Chunk
    pytest.param(
        lambda: Chunk("H", ["rank:1/cuda:1"]),  # type: ignore[arg-type]
        NotImplementedError,
        "ChunkShardingSpec does not support named dimension 'H': give an int dim.",
        id="chunk-named-dim",
    ),
    pytest.param(
        lambda: Chunk(1.0, [0]),  # type: ignore[arg-type]
        SpecError,
        "Chunk dim must be an int, got 1.0.",
        id="chunk-float-dim",
    ),
    pytest.param(
        lambda: Chunk(True, [0]),
        SpecError,
        "Chunk dim must be an int, got True.",
        id="chunk-bool-dim",
    ),
    pytest.param(
        lambda: Chunk(2, ["rank:1/cuda:1"]).layout((10, 20)),
        SpecError,
        "Invalid sharding dim: 2 for a 2-D array (valid: -2 to 1).",
        id="chunk-dim-too-large",
    ),
    pytest.param(
        lambda: Chunk(-3, ["rank:1/cuda:1"]).layout((10, 20)),
        SpecError,
        "Invalid sharding dim: -3 for a 2-D array (valid: -2 to 1).",
        id="chunk-dim-too-small",
    ),
    pytest.param(
        lambda: fshard.zeros(Chunk(4, [0]), 10, 20),
        SpecError,
        "Invalid sharding dim: 4 for a 2-D array (valid: -2 to 1).",
        id="chunk-dim-in-creation",
    ),
    pytest.param(
        lambda: Chunk(0, [0]).layout(()),
        SpecError,
        "Invalid sharding dim: 0 for a 0-D array (it has no dim to split; use Replicated or Single).",
        id="chunk-of-a-scalar",
    ),
    pytest.param(
        lambda: Chunk(0, []),
        SpecError,
        "Chunk needs at least one placement, got none.",
        id="chunk-no-placements",
    ),
    # -- Mesh and Named
    pytest.param(
        lambda: Mesh((2, 2), ranks=[0, 1, 2]),
        SpecError,
        "Mesh of shape (2, 2) needs 4 placements, got 3.",
        id="mesh-wrong-placement-count",
    ),
    pytest.param(
        lambda: Named(Mesh((2, 2)), ("z",)),
        SpecError,
        "Mesh has no axis 'z'; its axes are ('x', 'y').",
        id="named-unknown-axis",
    ),
    pytest.param(
        lambda: Named(Mesh((2, 2)), ("x", "x")),
        SpecError,
        "Partition ('x', 'x') uses a mesh axis twice; each axis may split one dim.",
        id="named-axis-twice",
    ),
    pytest.param(
        lambda: Named(Mesh((2,)), ("x", None)).layout((4,)),
        SpecError,
        "Partition ('x', None) has 2 entries for a 1-D array.",
        id="named-too-many-entries",
    ),
    # -- Layout
    pytest.param(
        lambda: Layout((4,), [ShardMeta((0,), (3,), 0), ShardMeta((2,), (2,), 1)]),
        LayoutError,
        "Shards 0 [offsets (0,), sizes (3,)] on rank:0/cpu and 1 [offsets (2,), sizes (2,)] on rank:1/cpu overlap "
        "at element (2,) without being identical: boxes must be disjoint, or identical to be replicas.",
        id="layout-overlap",
    ),
    pytest.param(
        lambda: Explicit([((0, 0), (2, 2), 0), ((2, 0), (1, 2), 1)]).layout((4, 2)),
        LayoutError,
        "Shards do not cover element (3, 0) of shape (4, 2) (the distinct boxes hold 6 of 8 elements): "
        "add a shard that covers it.",
        id="layout-gap",
    ),
    pytest.param(
        lambda: Layout((4,), [ShardMeta((0,), (5,), 0)]),
        LayoutError,
        "Shard 0 [offsets (0,), sizes (5,)] on rank:0/cpu extends past shape (4,) in dim 0 (0 + 5 > 4): "
        "shrink the shard or grow the shape.",
        id="layout-out-of-bounds",
    ),
    pytest.param(
        lambda: Layout((4,), [ShardMeta((0, 0), (4, 1), 0)]),
        LayoutError,
        "Shard 0 [offsets (0, 0), sizes (4, 1)] on rank:0/cpu has 2 dims but shape (4,) has 1: "
        "give every shard one offset and one size per dimension.",
        id="layout-wrong-ndim",
    ),
    pytest.param(
        lambda: Layout((4,), [ShardMeta((0,), (4,), 1), ShardMeta((0,), (4,), 1)]),
        LayoutError,
        "Shards 0 and 1 are the same box [offsets (0,), sizes (4,)] on rank:1/cpu: a replica must sit on "
        "another placement; drop the duplicate.",
        id="layout-duplicate-shard",
    ),
    pytest.param(
        lambda: Layout.from_dict({"shape": [1]}),
        LayoutError,
        "Not a layout dict (want keys 'shape' and 'shards'): KeyError('shards')",
        id="layout-from-dict-missing-key",
    ),
    pytest.param(
        lambda: Layout.from_torch_metadata(5),
        LayoutError,
        "Expected a torch ShardedTensorMetadata, got int.",
        id="layout-from-torch-metadata-not-metadata",
    ),
    pytest.param(
        lambda: Layout.from_torch_metadata(_torch_metadata_with_worker_name()),
        LayoutError,
        "Placement worker0/cuda:1 names no rank (an RPC worker name or a bare device); "
        "fshard needs 'rank:<int>/<device>'.",
        id="layout-from-torch-metadata-worker-name",
    ),
    # -- specs against shapes
    pytest.param(
        lambda: fshard.shard(torch.ones(3), "rows"),
        SpecError,
        "Expected a spec (Chunk, Named, Replicated, Single, Explicit, Partial) or a Layout, got 'rows'.",
        id="spec-not-a-spec",
    ),
    pytest.param(
        lambda: fshard.shard(torch.ones(3), HALVES),
        SpecError,
        "Layout has shape (4,) but the array has shape (3,).",
        id="shard-to-layout-of-another-shape",
    ),
    pytest.param(
        lambda: fshard.reshard(ROWS, Chunk(0, [0, 1]).layout((10,))),
        SpecError,
        "Layout has shape (10,) but the array has shape (10, 20).",
        id="reshard-to-layout-of-another-shape",
    ),
    pytest.param(
        lambda: fshard.zeros(HALVES, 5),
        SpecError,
        "Layout has shape (4,) but the array has shape (5,).",
        id="create-with-layout-of-another-shape",
    ),
    # -- shard, gather, reshard
    pytest.param(
        lambda: fshard.shard([1.0, 2.0], Chunk(0, [0])),
        TypeError,
        "shard() input must be a torch.Tensor, got list.",
        id="shard-list",
    ),
    pytest.param(
        lambda: fshard.shard(np.zeros(3), Chunk(0, [0])),
        TypeError,
        "shard() input must be a torch.Tensor, got ndarray.",
        id="shard-numpy-array",
    ),
    pytest.param(
        lambda: fshard.shard(torch.ones(3).to_sparse(), Chunk(0, [0])),
        SpecError,
        "shard() input has layout torch.sparse_coo; only torch.strided tensors can be sharded.",
        id="shard-sparse",
    ),
    pytest.param(
        lambda: fshard.shard(None, Chunk(0, [0, 1]), src=0),
        SpecError,
        "shard(..., src=0) needs a tensor on rank 0, got None.",
        id="shard-src-without-tensor",
    ),
    pytest.param(
        lambda: fshard.gather(torch.ones(2)),
        TypeError,
        "gather() takes a ShardedArray, got Tensor.",
        id="gather-tensor",
    ),
    pytest.param(
        lambda: fshard.gather(None),
        TypeError,
        "gather() takes a ShardedArray, got NoneType.",
        id="gather-none",
    ),
    pytest.param(
        lambda: fshard.reshard(torch.ones(2), Chunk(0, [0])),
        TypeError,
        "reshard() takes a ShardedArray, got Tensor.",
        id="reshard-tensor",
    ),
    pytest.param(
        lambda: fshard.equal(ROWS, torch.ones(10, 20)),
        TypeError,
        "equal() takes a ShardedArray, got Tensor.",
        id="equal-tensor",
    ),
    # -- map_local
    pytest.param(
        lambda: fshard.map_local(torch.add, ROWS, COLS),
        SpecError,
        "map_local() arguments 0 and 1 have different layouts; pass out_spec= for the result (the arrays then "
        "pair placement by placement), or reshard argument 1 first: fshard.reshard(x, other.layout).",
        id="map-local-different-layouts",
    ),
    pytest.param(
        lambda: fshard.map_local(lambda t: t[:1], ROWS),
        SpecError,
        "map_local() fn changed dim 0, which the layout splits, from sizes [3, 3, 3, 1] to [[1], [1], [1], [1]]; "
        "pass out_spec= for the result.",
        id="map-local-resized-split-dim",
    ),
    pytest.param(
        lambda: fshard.map_local(lambda t: t.sum(), ROWS),
        SpecError,
        "map_local() fn changed the number of dims; pass out_spec=Layout(...) for the result.",
        id="map-local-changed-ndim",
    ),
    pytest.param(
        lambda: fshard.map_local(lambda t: t[:, : 1 + (t.shape[0] == 3)], ROWS),
        SpecError,
        "map_local() cannot infer the new extent of dim 1 from the shards held here "
        "(new sizes per interval: {(0, 20): [1, 2]}); pass out_spec=Layout(...).",
        id="map-local-inconsistent-unsplit-dim",
    ),
    pytest.param(
        lambda: fshard.map_local(lambda t: t[:1], ROWS, out_spec=ROWS.layout),
        SpecError,
        "map_local() result 0 on placement rank:0/cpu has shape (1, 20) but out_spec gives that block sizes (3, 20) "
        "(global shape (10, 20)).",
        id="map-local-out-spec-disagrees",
    ),
    pytest.param(
        lambda: fshard.map_local(torch.neg),
        TypeError,
        "map_local() needs at least one ShardedArray.",
        id="map-local-no-arrays",
    ),
    pytest.param(
        lambda: fshard.map_local(torch.add, ROWS, torch.ones(10, 20)),
        TypeError,
        "map_local() argument 1 takes a ShardedArray, got Tensor.",
        id="map-local-tensor-argument",
    ),
    pytest.param(
        lambda: fshard.map_local(lambda t: 3, ROWS),
        TypeError,
        "map_local() fn result must be a torch.Tensor, got int.",
        id="map-local-result-not-a-tensor",
    ),
    # -- from_local_shards_and_layout and Shard
    pytest.param(
        lambda: fshard.from_local_shards_and_layout(PARTS[:1], HALVES),
        LayoutError,
        f"Local shards do not match the layout on this process: missing [{HALVES.shards[1]!r}], unexpected [].",
        id="from-local-shards-missing",
    ),
    pytest.param(
        lambda: fshard.from_local_shards_and_layout([*PARTS, EXTRA], HALVES),
        LayoutError,
        f"Local shards do not match the layout on this process: missing [], unexpected [{EXTRA.meta!r}].",
        id="from-local-shards-extra",
    ),
    pytest.param(
        lambda: fshard.from_local_shards_and_layout(PARTS, Chunk(0, [0, 1])),
        SpecError,
        "from_local_shards_and_layout() needs a Layout, got Chunk.",
        id="from-local-shards-spec-not-layout",
    ),
    pytest.param(
        lambda: fshard.from_local_shards_and_layout([torch.zeros(2)], HALVES),
        TypeError,
        "Expected fshard.Shard values, got Tensor.",
        id="from-local-shards-tensor-not-shard",
    ),
    pytest.param(
        lambda: fshard.from_local_shards_and_layout(
            [PARTS[0], Shard(HALVES.shards[1], torch.zeros(2, dtype=torch.int64))], HALVES
        ),
        LayoutError,
        "Local shards differ in dtype or requires_grad; make them agree.",
        id="from-local-shards-dtypes-differ",
    ),
    pytest.param(
        lambda: Shard(ShardMeta((0,), (2,), 0), torch.zeros(3)),
        LayoutError,
        "Shard data has shape (3,) but its box has sizes (2,).",
        id="shard-data-shape-disagrees-with-meta",
    ),
    pytest.param(
        lambda: Shard(ShardMeta((0,), (2,), 0), [0.0, 0.0]),  # type: ignore[arg-type]
        TypeError,
        "Shard data must be a torch.Tensor, got list.",
        id="shard-data-not-a-tensor",
    ),
    # -- ShardedArray
    pytest.param(
        lambda: ROWS.size(2),
        IndexError,
        "Dimension out of range (expected to be in range of [-2, 1], but got 2)",
        id="array-size-out-of-range",
    ),
    pytest.param(
        lambda: ROWS.local_tensor(),
        NotImplementedError,
        "Only single local shard is supported. This process holds 4; use addressable_shards.",
        id="array-local-tensor-of-many",
    ),
    pytest.param(
        lambda: setattr(ROWS, "_data", ()),
        AttributeError,
        "ShardedArray is immutable: cannot set '_data'; fshard functions return new arrays.",
        id="array-setattr",
    ),
    pytest.param(
        lambda: delattr(ROWS, "_layout"),
        AttributeError,
        "ShardedArray is immutable: cannot delete '_layout'.",
        id="array-delattr",
    ),
    pytest.param(
        lambda: torch.mul(ROWS, 2),
        TypeError,
        "torch.mul is not supported for ShardedArray: apply it to the shards with fshard.map_local, or gather() first.",
        id="array-torch-function",
    ),
    pytest.param(
        lambda: ShardedArray(HALVES, [torch.zeros(2)], LOCAL),
        LayoutError,
        f"Expected 2 addressable shard tensors for {HALVES!r}, got 1.",
        id="array-wrong-shard-count",
    ),
    pytest.param(
        lambda: ShardedArray(HALVES, [torch.zeros(2), torch.zeros(2, dtype=torch.int64)], LOCAL),
        LayoutError,
        "Shard tensors have different dtypes [torch.float32, torch.int64]: give every shard one dtype.",
        id="array-dtypes-differ",
    ),
    pytest.param(
        lambda: _unflatten_with(ROWS, lambda t: t[:, :2]),
        LayoutError,
        "Shard 0 tensor has shape (3, 2) but the layout gives it sizes (3, 20): a pytree transform must keep "
        "every shard's shape, or (torch.func.vmap) add one leading batch dim to all of them. With vmap's out_dims "
        "other than 0, return the shard tensors (optree.tree_leaves(result)) or fshard.gather(result) from the "
        "vmapped function instead of the array.",
        id="array-unflatten-wrong-shape",
    ),
    # -- the local backend
    pytest.param(
        lambda: fshard.zeros(Chunk(0, ["rank:0/cuda:99"]), 3),
        SpecError,
        f"Placement device 'cuda:99' is not available in this process (torch.cuda.device_count() = {N_CUDA}): "
        "place shards on 'cpu' or on a device that exists.",
        id="local-device-not-available",
    ),
]


@pytest.mark.parametrize(("call", "error", "message"), CASES)
def test_bad_input_raises(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        call()
    assert info.type is error
    assert str(info.value) == message


def test_bad_input_leaves_arrays_unchanged():
    for call in (lambda: fshard.map_local(lambda t: t[:1], ROWS), lambda: setattr(ROWS, "_data", ())):
        with pytest.raises((SpecError, AttributeError)):
            call()
    assert torch.equal(fshard.gather(ROWS), torch.arange(200.0).reshape(10, 20))


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (LayoutError, ValueError),
        (SpecError, ValueError),
        (CollectiveMismatchError, RuntimeError),
        (CheckpointError, RuntimeError),
    ],
    ids=lambda v: v.__name__,
)
def test_error_hierarchy(error, builtin):
    assert issubclass(error, FShardError)
    assert issubclass(error, builtin)
    assert issubclass(FShardError, Exception)
    assert not issubclass(FShardError, (ValueError, RuntimeError))
    with pytest.raises(builtin):
        raise error("x")
    with pytest.raises(FShardError):
        raise error("x")


def test_layout_and_spec_errors_are_distinct():
    assert LayoutError is not SpecError
    assert not issubclass(LayoutError, SpecError)
    assert not issubclass(SpecError, LayoutError)
    assert not issubclass(CollectiveMismatchError, CheckpointError)
