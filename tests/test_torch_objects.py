"""torch's sharding objects in, fshard values out: placements, shard metadata, specs, ShardedTensors.

The first tables run in one process on the local backend; ShardedTensors live in a
process group, so their cases run on the 4-process Gloo pool.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec
from torch.distributed.remote_device import _remote_device

import fshard
from fshard import Chunk, Explicit, Layout, Placement, ShardMeta
from fshard._layout.placement import as_placement
from fshard._layout.specs import as_layout
from fshard._layout.torch_meta import box_from_torch

RANKS = [0, 1, 2, 3]
CPU = [f"rank:{r}/cpu" for r in RANKS]
X = torch.arange(60.0).reshape(10, 6)
BOXES = [ShardMetadata([0, 0], [4, 6], "rank:2/cpu"), ShardMetadata([4, 0], [6, 6], "rank:0/cpu")]
FSHARD_BOXES = [ShardMeta((0, 0), (4, 6), 2), ShardMeta((4, 0), (6, 6), 0)]


def _chunk_spec_mutating(placements: list[str]) -> list:
    """The placements list after ChunkShardingSpec read it: its strings became _remote_device objects."""
    ChunkShardingSpec(dim=0, placements=placements)
    return placements


# -- torch object in, fshard value out ----------------------------------------------------------

CONVERSIONS = [
    pytest.param(lambda: as_placement(_remote_device("rank:1/cuda:1")), Placement(1, "cuda:1"), id="remote-device"),
    pytest.param(lambda: as_placement(_remote_device("rank:3/cpu")), Placement(3), id="remote-device-cpu"),
    pytest.param(
        lambda: Chunk(0, _chunk_spec_mutating(list(CPU))), Chunk(0, RANKS), id="chunk-after-chunk-sharding-spec"
    ),
    pytest.param(lambda: fshard.Single(_remote_device("rank:2/cpu")), fshard.Single(2), id="single-of-remote-device"),
    pytest.param(
        lambda: ShardMeta(*box_from_torch(ShardMetadata([0, 4], [2, 4], "rank:1/cpu"))),
        ShardMeta((0, 4), (2, 4), 1),
        id="shard-metadata",
    ),
    pytest.param(lambda: Explicit(BOXES), Explicit(FSHARD_BOXES), id="explicit-of-shard-metadata"),
    pytest.param(
        lambda: Layout.from_torch_metadata(BOXES), Layout((10, 6), FSHARD_BOXES), id="layout-from-shard-metadata-list"
    ),
    pytest.param(
        lambda: Layout.from_torch_metadata(Chunk(1, RANKS).layout((10, 6)).to_torch_metadata()),
        Chunk(1, RANKS).layout((10, 6)),
        id="layout-from-sharded-tensor-metadata",
    ),
    pytest.param(
        lambda: as_layout(ChunkShardingSpec(dim=1, placements=CPU[::-1]), (10, 6)),
        Chunk(1, RANKS[::-1]).layout((10, 6)),
        id="chunk-sharding-spec",
    ),
    pytest.param(
        lambda: as_layout(ChunkShardingSpec(dim=-1, placements=CPU), (10, 6)),
        ChunkShardingSpec(dim=-1, placements=CPU).build_metadata(torch.Size((10, 6)), TensorProperties()),
        id="chunk-sharding-spec-as-torch-builds-it",
    ),
    pytest.param(
        lambda: as_layout(EnumerableShardingSpec(list(BOXES)), (10, 6)),
        Layout((10, 6), FSHARD_BOXES),
        id="enumerable-sharding-spec",
    ),
]


@pytest.mark.parametrize(("convert", "want"), CONVERSIONS)
def test_torch_object_converts(convert, want) -> None:
    got = convert()
    if not isinstance(want, (Layout, Placement, ShardMeta, Chunk, Explicit, fshard.Single)):
        want = Layout.from_torch_metadata(want)  # torch's own metadata for the same spec
    assert got == want


SPECS = {
    "chunk": ChunkShardingSpec(dim=0, placements=CPU),
    "chunk-shuffled-cols": ChunkShardingSpec(dim=1, placements=[CPU[2], CPU[0], CPU[3], CPU[1]]),
    "enumerable": EnumerableShardingSpec(list(BOXES)),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_function_that_takes_a_spec_takes_torch_specs(name, tmp_path) -> None:
    spec = SPECS[name]
    want = Layout.from_torch_metadata(spec.build_metadata(torch.Size(X.shape), TensorProperties()))
    x = fshard.shard(X, spec)
    assert x.layout == want
    assert torch.equal(fshard.gather(x), X)
    moved = fshard.reshard(fshard.shard(X, Chunk(1, [3, 1])), spec)
    assert moved.layout == want
    assert torch.equal(fshard.gather(moved), X)
    for made in (
        fshard.zeros(spec, 10, 6),
        fshard.full(spec, (10, 6), fill_value=2.0),
        fshard.rand(spec, 10, 6, seed=0),
    ):
        assert made.layout == want
    fshard.save(tmp_path, {"x": fshard.shard(X, Chunk(0, [1, 2]))})
    loaded = fshard.load(tmp_path, specs={"x": spec})["x"]
    assert loaded.layout == want
    assert torch.equal(fshard.gather(loaded), X)
    parts = [torch.full(m.sizes, float(m.placement.rank)) for m in want.shards]
    assert fshard.from_local_tensor(parts, spec, X.shape).layout == want


# -- what cannot be converted raises, naming the fix ----------------------------------------


def _partial_to_sharded_tensor() -> None:
    fshard.to_sharded_tensor(fshard.shard(torch.ones(2, 2), fshard.Partial(fshard.Replicated([0, 1]))))


ERRORS = [
    pytest.param(
        lambda: as_placement(_remote_device("worker0/cuda:0")),
        fshard.SpecError,
        "Placement worker0/cuda:0 (a torch _remote_device) names an RPC worker, not a rank: fshard has no RPC; "
        "write it as 'rank:<int>/cuda:0'.",
        id="remote-device-worker-name",
    ),
    pytest.param(
        lambda: Explicit([ShardMetadata([0], [2])]),
        fshard.LayoutError,
        "ShardMetadata(shard_offsets=[0], shard_sizes=[2]) has no placement: fshard needs one, such as "
        "placement='rank:0/cpu'.",
        id="shard-metadata-without-placement",
    ),
    pytest.param(
        lambda: Explicit([5]),
        fshard.SpecError,
        "Explicit() box 0 is 5 (int): give a ShardMeta, an (offsets, sizes, placement) tuple, or torch's "
        "ShardMetadata.",
        id="explicit-of-a-non-box",
    ),
    pytest.param(
        lambda: Explicit(EnumerableShardingSpec(list(BOXES))),
        fshard.SpecError,
        "Explicit() takes a list of boxes, got torch's EnumerableShardingSpec: pass its .shards.",
        id="explicit-of-a-torch-spec",
    ),
    pytest.param(
        lambda: Layout.from_torch_metadata([]),
        fshard.LayoutError,
        "Layout.from_torch_metadata() got an empty list of ShardMetadata: give at least one.",
        id="layout-from-empty-list",
    ),
    pytest.param(
        lambda: Layout.from_torch_metadata([ShardMetadata([3], [0], "rank:0/cpu")]),
        fshard.LayoutError,
        "Layout.from_torch_metadata() got a list of ShardMetadata whose boxes are all empty, which does not tell "
        "the shape: give a ShardedTensorMetadata (its size is the shape).",
        id="layout-from-a-list-of-empty-boxes",
    ),
    pytest.param(
        lambda: fshard.shard(X, EnumerableShardingSpec([ShardMetadata([0, 0], [5, 6], "rank:0/cpu")])),
        fshard.LayoutError,
        "Shards do not cover element (5, 0) of shape (10, 6)",
        id="enumerable-spec-with-a-gap",
    ),
    pytest.param(
        _partial_to_sharded_tensor,
        fshard.SpecError,
        "to_sharded_tensor() got an array with a pending sum (fshard.Partial), which a ShardedTensor cannot hold: "
        "reshard it to a non-partial spec first",
        id="to-sharded-tensor-of-a-partial-array",
    ),
]


@pytest.mark.parametrize(("make", "error", "message"), ERRORS)
def test_what_cannot_be_converted_raises(make, error, message) -> None:
    with pytest.raises(error, match=re.escape(message)):
        make()


def test_named_dimension_in_a_chunk_sharding_spec_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="does not support named dimension"):
        fshard.shard(X, ChunkShardingSpec(dim="rows", placements=CPU))


# -- ShardedTensors, on 4 Gloo processes -------------------------------------------------------

pool = pytest.mark.multiprocess


def _sharded_tensor(spec) -> object:
    from torch.distributed._shard import sharded_tensor

    st = sharded_tensor.empty(spec, *X.shape)
    for s in st.local_shards():
        o, n = s.metadata.shard_offsets, s.metadata.shard_sizes
        s.tensor.copy_(X[o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
    return st


class _WithShardedTensors(torch.nn.Module):
    def __init__(self, spec) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 2)
        self.table = _sharded_tensor(spec) if spec is not None else None


def _sharded_tensors_convert() -> dict[str, bool]:
    spec = ChunkShardingSpec(dim=0, placements=[CPU[2], CPU[0], CPU[3], CPU[1]])
    want = Layout.from_torch_metadata(spec.build_metadata(torch.Size(X.shape), TensorProperties()))
    st = _sharded_tensor(spec)
    out = {}
    # A torch state dict holding ShardedTensors (as torch's state_dict_hook makes it), in one call.
    tree = fshard.shard_params({"table": st, "step": torch.tensor(3)})
    out["state-dict"] = tree["table"].layout == want and torch.equal(fshard.gather(tree["table"]), X)
    out["state-dict-shares-shards"] = tree["table"].local_tensor().data_ptr() == st.local_tensor().data_ptr()
    resharded = fshard.shard_params({"table": st}, lambda name, a: Chunk(1, RANKS))["table"]
    out["state-dict-resharded"] = resharded.layout == Chunk(1, RANKS).layout(X.shape)
    # A module attribute that is a ShardedTensor joins shard_params' dict, converted.
    params = fshard.shard_params(_WithShardedTensors(spec))
    out["module-attribute"] = sorted(params) == ["linear.bias", "linear.weight", "table"] and torch.equal(
        fshard.gather(params["table"]), X
    )
    # *_like of a ShardedTensor: its layout.
    out["zeros-like"] = fshard.zeros_like(st).layout == want
    # shard() of a ShardedTensor is reshard(from_sharded_tensor(st), spec), through fshard._interop.torch_objects.
    from fshard._interop.torch_objects import shard_already_sharded

    x = shard_already_sharded(st, fshard.Replicated(RANKS))
    out["shard-of-sharded-tensor"] = torch.equal(x.local_tensor(), X)
    try:
        shard_already_sharded(st, Chunk(0, RANKS), src=0)
        out["src-refused"] = False
    except fshard.SpecError as exc:
        out["src-refused"] = "fshard.reshard(fshard.from_sharded_tensor(st), spec)" in str(exc)
    return out


@pool
def test_sharded_tensors_convert(dist_pool) -> None:
    for result in dist_pool.run(_sharded_tensors_convert):
        assert result == dict.fromkeys(result, True)
        assert len(result) == 7


def _shard_of_a_sharded_tensor() -> str:
    spec = ChunkShardingSpec(dim=0, placements=CPU)
    try:
        x = fshard.shard(_sharded_tensor(spec), Chunk(1, RANKS))
    except Exception as exc:
        return type(exc).__name__
    return "ok" if torch.equal(fshard.gather(x), X) and x.layout == Chunk(1, RANKS).layout(X.shape) else "wrong"


@pool
def test_shard_of_a_sharded_tensor_converts_it(dist_pool) -> None:
    assert dist_pool.run(_shard_of_a_sharded_tensor) == ["ok"] * 4
