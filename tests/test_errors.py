"""Bad input across the public API, and the exact error each one raises.

One table: every row is a call, the error type it must raise and its whole message.
Messages name the offending value and say what would be valid (DESIGN.md section 3).
"""

from __future__ import annotations

import re
import warnings

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
    Partial,
    Placement,
    Replicated,
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
        "Mesh of shape (2, 2) needs 4 placements, got 3. Give ranks= one per position.",
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
        "gather() takes a ShardedArray, got Tensor. A pytree of ShardedArrays is taken too.",
        id="gather-tensor",
    ),
    pytest.param(
        lambda: fshard.gather(None),
        TypeError,
        "gather() takes a ShardedArray, got NoneType. A pytree of ShardedArrays is taken too.",
        id="gather-none",
    ),
    pytest.param(
        lambda: fshard.reshard(torch.ones(2), Chunk(0, [0])),
        TypeError,
        "reshard() takes a ShardedArray, got Tensor. A pytree of ShardedArrays is taken too.",
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
        "map_local() fn returned a result of 0 dims (a block of shape []) from blocks of 2; pass out_spec= for that "
        "result (a spec, or a Layout).",
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
        "Local shards differ: the shard at offsets (0,) on rank 0 is torch.float32 with requires_grad=False, the one "
        "at offsets (2,) on rank 1 torch.int64 with requires_grad=False; give every shard one dtype, and "
        "requires_grad on every shard or on none.",
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
    pytest.param(
        lambda: torch.func.vmap(fshard.gather)(fshard.shard(torch.zeros(2, 4, 6), Chunk(1, [0, 1]))),
        LayoutError,
        "Shard 0 tensor has shape (2, 6) but the layout gives it sizes (2, 2, 6): a pytree transform must keep "
        "every shard's shape, or (torch.func.vmap) add one leading batch dim to all of them. With vmap's out_dims "
        "other than 0, return the shard tensors (optree.tree_leaves(result)) or fshard.gather(result) from the "
        "vmapped function instead of the array. A dim fewer than the layout's: torch.func.vmap maps an array "
        "passed with in_dims=0 over its shards' first dim. Give arrays in_dims None (vmap(f, in_dims=(0, None))): "
        "an array's layout describes one sample; batch plain tensors and shard them inside the function.",
        id="array-vmapped-over-its-shards",
    ),
    # -- the local backend
    pytest.param(
        lambda: fshard.zeros(Chunk(0, ["rank:0/cuda:99"]), 3),
        SpecError,
        f"Placement device 'cuda:99' is not available in this process (torch.cuda.device_count() = {N_CUDA}): "
        "place shards on 'cpu' or on a device that exists.",
        id="local-device-not-available",
    ),
    # -- garbage that the fuzzer (property_tests/test_fuzz.py) found
    pytest.param(
        lambda: Chunk(0, None),
        SpecError,
        "Chunk placements must be a placement or a list of them, got None (NoneType).",
        id="chunk-placements-none",
    ),
    pytest.param(
        lambda: Explicit(5),
        SpecError,
        "Explicit() shards must be a list or tuple, got 5 (int).",
        id="explicit-shards-not-a-list",
    ),
    pytest.param(
        lambda: Named(Mesh((2, 2)), "xy"),
        SpecError,
        "Named partition must be a list or tuple, got 'xy' (str).",
        id="named-partition-str",
    ),
    pytest.param(
        lambda: Mesh((2,), axis_names=[1]),
        SpecError,
        "Mesh axis names must be str, such as 'x', got (1,).",
        id="mesh-axis-name-int",
    ),
    pytest.param(
        lambda: Mesh((2**40,)),
        SpecError,
        "Mesh of shape (1099511627776,) has 1099511627776 positions; give ranks= or at most 1048576 positions.",
        id="mesh-too-large",
    ),
    pytest.param(
        lambda: Partial(ROWS),
        SpecError,
        f"Partial() takes a spec (Chunk, Named, Replicated, Single, Explicit) or a Layout, got {ROWS!r}.",
        id="partial-of-an-array",
    ),
    pytest.param(
        lambda: fshard.zeros(Chunk(0, [0]), 3, dtype="float32"),
        TypeError,
        "dtype must be a torch.dtype such as torch.float32, got 'float32' (str).",
        id="create-dtype-str",
    ),
    pytest.param(
        lambda: fshard.zeros(Chunk(0, [0]), 3, device=[0]),
        SpecError,
        "device=[0] is not a torch device such as 'cpu' or 'cuda:0'.",
        id="create-device-list",
    ),
    pytest.param(
        lambda: fshard.ones(Chunk(0, [0]), 3, requires_grad="yes"),
        TypeError,
        "requires_grad must be True or False, got 'yes' (str).",
        id="create-requires-grad-str",
    ),
    pytest.param(
        lambda: fshard.ones(Chunk(0, [0]), 3, dtype=torch.int64, requires_grad=True),
        TypeError,
        "requires_grad=True needs a floating point or complex dtype, got torch.int64.",
        id="create-requires-grad-int",
    ),
    pytest.param(
        lambda: fshard.empty(Replicated([0]), 2**62, 4),
        LayoutError,
        "shape (4611686018427387904, 4) gives shard 0 sizes (4611686018427387904, 4): more than 2**63 - 1 bytes of "
        "torch.float32, the most one tensor holds. Use a smaller shape or more shards.",
        id="create-shard-too-large",
    ),
    pytest.param(
        lambda: fshard.full(Chunk(0, [0]), 3, fill_value=[1]),
        TypeError,
        "fill_value must be a number, got [1] (list).",
        id="full-fill-value-list",
    ),
    pytest.param(
        lambda: fshard.full(Chunk(0, [0]), 3, fill_value=2**40, dtype=torch.int32),
        SpecError,
        "fill_value=1099511627776 does not fit dtype torch.int32: give a value in its range.",
        id="full-fill-value-overflow",
    ),
    pytest.param(
        lambda: fshard.rand(Chunk(0, [0]), 3, seed=2.5),
        TypeError,
        "seed must be an int or None, got 2.5 (float).",
        id="rand-seed-float",
    ),
    pytest.param(
        lambda: fshard.zeros_like(None),
        TypeError,
        "zeros_like() takes a ShardedArray, got NoneType.",
        id="zeros-like-none",
    ),
    pytest.param(
        lambda: fshard.to_sharded_tensor(None),
        TypeError,
        "to_sharded_tensor() takes a ShardedArray, got NoneType.",
        id="to-sharded-tensor-none",
    ),
    pytest.param(
        lambda: fshard.to_dtensor(ROWS, "x"),
        SpecError,
        "to_dtensor() needs an fshard.Mesh or a torch DeviceMesh, got str.",
        id="to-dtensor-mesh-str",
    ),
    pytest.param(
        lambda: fshard.from_dtensor(None),
        TypeError,
        "from_dtensor() takes a torch DTensor, got NoneType: shard a tensor with fshard.shard(t, spec), or make a "
        "DTensor first (DTensor.from_local).",
        id="from-dtensor-none",
    ),
    pytest.param(
        lambda: fshard.from_sharded_tensor(None),
        TypeError,
        "from_sharded_tensor() takes a torch ShardedTensor, got NoneType. For a state dict that mixes "
        "ShardedTensors and tensors, fshard.shard_params(state_dict) converts each ShardedTensor and keeps the rest.",
        id="from-sharded-tensor-none",
    ),
    pytest.param(
        lambda: fshard.from_local_shards(None, (4,)),
        TypeError,
        "from_local_shards() takes a sequence of fshard.Shard, got NoneType.",
        id="from-local-shards-none",
    ),
    pytest.param(
        lambda: fshard.from_local_shards([], (4,), group=3),
        TypeError,
        "from_local_shards() group= takes a torch.distributed ProcessGroup or None, got int.",
        id="from-local-shards-group-int",
    ),
    pytest.param(
        lambda: fshard.from_local_shards([Shard(ShardMeta((0,), (2,), 0), torch.ones(2).to_sparse())], (2,)),
        LayoutError,
        "from_local_shards(): shard [offsets (0,), sizes (2,)] on rank:0/cpu has layout torch.sparse_coo; only "
        "torch.strided tensors can be sharded.",
        id="from-local-shards-sparse",
    ),
    pytest.param(
        lambda: fshard.from_local_tensor(torch.ones(2), dim="x"),
        TypeError,
        "from_local_tensor() dim must be an int, or a spec with the global shape, got 'x'.",
        id="from-local-tensor-dim-str",
    ),
    pytest.param(
        lambda: fshard.shard_params({"w": torch.ones(2)}, spec_fn=3),
        TypeError,
        "shard_params() spec_fn must be a function of (name, value) or None, got 3.",
        id="shard-params-spec-fn-int",
    ),
    pytest.param(
        lambda: fshard.load_state_dict(None, {}),
        TypeError,
        "load_state_dict() takes a torch.nn.Module, got NoneType.",
        id="load-state-dict-module-none",
    ),
    pytest.param(
        lambda: fshard.load_state_dict(torch.nn.Linear(2, 2), {}, strict="no"),
        TypeError,
        "load_state_dict() strict must be True or False, got 'no'.",
        id="load-state-dict-strict-str",
    ),
    pytest.param(
        lambda: fshard.load_state_dict(torch.nn.Linear(2, 2), {1: torch.ones(2)}),
        TypeError,
        "load_state_dict() tree keys must be str names, got 1 (int).",
        id="load-state-dict-int-key",
    ),
    pytest.param(
        lambda: fshard.clip_grad_norm([ROWS], max_norm="1"),
        TypeError,
        "clip_grad_norm() max_norm must be a real number, got '1' (str).",
        id="clip-grad-norm-str",
    ),
    pytest.param(
        lambda: fshard.clip_grad_norm([ROWS], max_norm=-1.0),
        SpecError,
        "clip_grad_norm() max_norm=-1.0: give a finite number of at least 0.",
        id="clip-grad-norm-negative",
    ),
    pytest.param(
        lambda: fshard.save(3, {}),
        TypeError,
        "save() path must be a str or an os.PathLike, got int.",
        id="save-path-int",
    ),
    pytest.param(
        lambda: fshard.load(None),
        TypeError,
        "load() path must be a str or an os.PathLike, got NoneType.",
        id="load-path-none",
    ),
    pytest.param(
        lambda: fshard.load("a\x00b"),
        CheckpointError,
        "load() path 'a\\x00b' holds a NUL character, which no file name can hold.",
        id="load-path-nul",
    ),
    pytest.param(
        lambda: fshard.load("ckpt", backend="local"),
        TypeError,
        "load() backend= takes an fshard backend or None, got str.",
        id="load-backend-str",
    ),
    pytest.param(
        lambda: fshard.checkpoint_info(None),
        TypeError,
        "checkpoint_info() path must be a str or an os.PathLike, got NoneType.",
        id="checkpoint-info-path-none",
    ),
    pytest.param(
        lambda: HALVES.visualize(10**6),
        SpecError,
        "visualize() width must be at most 1000 characters, got 1000000.",
        id="visualize-too-wide",
    ),
    pytest.param(
        lambda: HALVES.visualize(color=1),
        SpecError,
        "visualize() color must be True, False or 'auto', got 1.",
        id="visualize-color-int",
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


def test_save_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    target = tmp_path / "file" / "ckpt"
    message = f"Checkpoint path {target} lies under {tmp_path / 'file'}, which is not a directory."
    with pytest.raises(CheckpointError, match=re.escape(message)):
        fshard.save(target, {"x": ROWS})


def test_save_refuses_leaves_on_the_meta_device(tmp_path):
    message = "Tensor at ['t'] is on the meta device, which holds no values to save."
    with pytest.raises(TypeError, match=re.escape(message)):
        fshard.save(tmp_path / "ckpt", {"t": torch.ones(2, device="meta")})
    assert not (tmp_path / "ckpt").exists()


def test_load_state_dict_mismatch_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match=re.escape("load_state_dict() tree does not fit the Linear: ")) as info:
        fshard.load_state_dict(torch.nn.Linear(2, 2), {})
    assert isinstance(info.value, RuntimeError)
    assert 'Missing key(s) in state_dict: "weight", "bias"' in str(info.value)


def test_global_norm_reads_sparse_leaves():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on sparse invariant checks and beta CSR support
        duplicates = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([3.0, 4.0]), (2, 2))
        compressed = torch.full((3, 4), 2.0).to_sparse_csr()
    assert float(fshard.global_norm([duplicates])) == 7.0  # one element holding 3 + 4
    assert float(fshard.global_norm([compressed])) == pytest.approx(float(torch.full((3, 4), 2.0).norm()))


def test_an_array_has_no_backward_and_the_error_names_the_two_that_are() -> None:
    w = torch.arange(4.0, requires_grad=True)
    total = fshard.shard_map(
        lambda b: (b * b).sum()[None],
        in_specs=(fshard.Chunk(0, [0, 1]),),
        out_specs=fshard.Partial(fshard.Replicated([0, 1])),
    )(w)
    with pytest.raises(TypeError, match=r"fshard\.backward\(loss\).*fshard\.gather\(loss\)\.backward\(\)"):
        total.backward()
    assert w.grad is None
    assert torch.equal(fshard.backward(total), torch.tensor([14.0]))
    assert torch.equal(w.grad, 2 * torch.arange(4.0))


def test_shard_map_names_the_argument_without_a_block_on_a_placement() -> None:
    """An argument on more placements than the first: the error names the one without a block, and where."""
    mesh = fshard.Mesh((2,), axis_names=("tp",), ranks=[1, 2])
    f = fshard.shard_map(
        lambda a, c: a * c, (fshard.Named(mesh, ("tp",)), fshard.Replicated([0, 1, 2, 3])), fshard.Named(mesh, ("tp",))
    )
    with pytest.raises(fshard.SpecError, match=r"argument 0 has no block on placement rank:0/cpu, where argument 1"):
        f(torch.arange(4.0), torch.ones(1))
    two = fshard.shard_map(lambda a: a, fshard.Chunk(0, [0, 0, 1]), fshard.Chunk(0, [0, 0, 1]))
    with pytest.raises(fshard.SpecError, match=r"gives placement rank:0/cpu 2 blocks"):
        two(torch.arange(6.0))


def test_results_of_other_dtypes_on_some_placements_raise_the_spec_error_of_every_backend() -> None:
    """The local backend raised the arrays' LayoutError; across processes the results are compared (SpecError)."""
    rows = fshard.Chunk(0, [0, 1, 2, 3])
    f = fshard.shard_map(lambda b: b.double() if b[0] < 0 else b, rows, rows)
    with pytest.raises(fshard.SpecError, match=re.escape("result 0 has dtypes ['torch.float32', 'torch.float64']")):
        f(torch.tensor([1.0, 2.0, 3.0, -4.0]))
