"""ShardedTensor and DTensor interop on 4 Gloo processes, checked against torch's own gather/full_tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.local import LocalBackend

ALL = [0, 1, 2, 3]
X = torch.randn(10, 12, generator=torch.Generator().manual_seed(1))
ODD = torch.arange(35.0).reshape(7, 5)  # sizes that the mesh does not divide


def _torch_gather(st) -> torch.Tensor | None:
    out = torch.empty(st.size(), dtype=st.dtype) if dist.get_rank() == 0 else None
    st.gather(dst=0, out=out)
    return out


SHARDED_TENSOR_LAYOUTS = {
    "rows": fshard.Chunk(0, ALL),
    "cols-with-empty": fshard.Chunk(1, [3, 2, 1, 0, 0, 1, 2, 3, 0, 1, 2, 3, 0]),
    "boxes": fshard.Explicit([((0, 0), (7, 5), 3), ((0, 5), (7, 7), 1), ((7, 0), (3, 12), 0)]),
    "rows-past-the-end": fshard.Chunk(0, ALL * 4),  # 16 rows of 1 for 10 rows: empty ones at rows 10-15
}
# ShardedTensor checks empty boxes against the shape: to_sharded_tensor moves them to the end.
IN_TORCH = {
    name: spec.layout(X.shape) for name, spec in SHARDED_TENSOR_LAYOUTS.items() if name != "rows-past-the-end"
} | {"rows-past-the-end": fshard.Layout(X.shape, [((min(i, 10), 0), (int(i < 10), 12), i % 4) for i in range(16)])}


def _to_and_from_sharded_tensor(name: str) -> tuple[bool, bool, bool]:
    x = fshard.shard(X, SHARDED_TENSOR_LAYOUTS[name])
    st = fshard.to_sharded_tensor(x)
    full = _torch_gather(st)
    matches_torch = full is None or torch.equal(full, X)
    same_metadata = fshard.Layout.from_torch_metadata(st.metadata()) == IN_TORCH[name]
    back = fshard.from_sharded_tensor(st)
    values = fshard.gather(back)
    return matches_torch, same_metadata, back.layout == IN_TORCH[name] and torch.equal(values, X)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(SHARDED_TENSOR_LAYOUTS))
def test_to_sharded_tensor_and_back(dist_pool, name):
    assert dist_pool.run(_to_and_from_sharded_tensor, name) == [(True, True, True)] * 4


def _from_torch_sharded_tensor() -> tuple[bool, bool]:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    st = sharded_tensor.empty(ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in (2, 0, 3, 1)]), *X.shape)
    for s in st.local_shards():
        o, n = s.metadata.shard_offsets, s.metadata.shard_sizes
        s.tensor.copy_(X[o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
    x = fshard.from_sharded_tensor(st)
    full, ours = _torch_gather(st), fshard.gather(x)  # collectives: every rank calls both
    return x.layout == fshard.Chunk(1, [2, 0, 3, 1]).layout(X.shape), full is None or torch.equal(full, ours)


@pytest.mark.multiprocess
def test_from_a_sharded_tensor_built_by_torch(dist_pool):
    assert dist_pool.run(_from_torch_sharded_tensor) == [(True, True)] * 4


def _replicas_refused() -> str:
    x = fshard.shard(X, fshard.Replicated(ALL))
    try:
        fshard.to_sharded_tensor(x)
    except fshard.SpecError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_sharded_tensor_cannot_hold_replicas(dist_pool):
    assert all("ShardedTensor cannot hold replicas" in m and "reshard" in m for m in dist_pool.run(_replicas_refused))


MESH = fshard.Mesh((2, 2))
DTENSOR_CASES = {
    "grid": (("x", "y"), "(Shard(dim=0), Shard(dim=1))"),
    "rows-over-both-axes": ((("x", "y"), None), "(Shard(dim=0), Shard(dim=0))"),
    "cols-and-replicas": ((None, "y"), "(Replicate(), Shard(dim=1))"),
    "transposed-axes": (("y", "x"), "(Shard(dim=1), Shard(dim=0))"),
    "replicated": ((None, None), "(Replicate(), Replicate())"),
}


def _to_and_from_dtensor(partition, with_device_mesh: bool) -> list[object]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y")) if with_device_mesh else MESH
    out: list[object] = []
    for full in (X, ODD):
        x = fshard.shard(full, fshard.Named(MESH, partition))
        dt = fshard.to_dtensor(x, mesh)
        out.append(str(dt.placements))
        out.append(torch.equal(dt.full_tensor(), full) and torch.equal(dt.to_local(), x.local_tensor()))
        back = fshard.from_dtensor(dt)
        values = fshard.gather(back)
        out.append(back.layout == x.layout and torch.equal(values, full))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("with_device_mesh", [False, True], ids=["fshard-mesh", "device-mesh"])
@pytest.mark.parametrize("case", sorted(DTENSOR_CASES))
def test_to_dtensor_and_back(dist_pool, case, with_device_mesh):
    partition, placements = DTENSOR_CASES[case]
    for result in dist_pool.run(_to_and_from_dtensor, partition, with_device_mesh):
        assert result == [placements, True, True] * 2


def _from_torch_dtensor() -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = []
    for placements in ([Shard(1), Replicate()], [Shard(0), Shard(0)], [Replicate(), Shard(1)]):
        for full in (X, ODD):
            dt = distribute_tensor(full, mesh, placements)
            x = fshard.from_dtensor(dt)
            values, expected = fshard.gather(x), dt.full_tensor()
            out.append(torch.equal(values, expected) and torch.equal(x.local_tensor(), dt.to_local()))
    return out


@pytest.mark.multiprocess
def test_from_a_dtensor_built_by_torch(dist_pool):
    assert all(all(r) for r in dist_pool.run(_from_torch_dtensor))


def _dtensors_where_tensors_go() -> list[object]:
    """A DTensor given to shard(), to shard_params() and elsewhere: converted where it is the whole argument,
    refused with the fix inside a tree and from src, on every rank alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dt = distribute_tensor(ODD, init_device_mesh("cpu", (4,)), [Shard(0)])
    spec = fshard.Chunk(1, [3, 2, 1, 0])
    moved = fshard.shard(dt, spec)
    params = fshard.shard_params({"w": dt, "b": torch.ones(2)}, lambda name, v: spec if name == "w" else None)
    out: list[object] = [
        moved.layout == spec.layout(ODD.shape) and torch.equal(fshard.gather(moved), ODD),
        isinstance(params["w"], fshard.ShardedArray) and torch.equal(fshard.gather(params["w"]), ODD),
        params["w"].layout == spec.layout(ODD.shape),
    ]
    return out + _spec_errors(
        lambda: fshard.shard({"w": dt}, spec),
        lambda: fshard.shard(dt, spec, src=0),
        lambda: fshard.shard(dt, spec, backend=LocalBackend(world_size=4)),
    )


def _spec_errors(*calls) -> list[str]:
    """Each call's SpecError message, or "no error"."""
    messages = []
    for call in calls:
        try:
            call()
            messages.append("no error")
        except fshard.SpecError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.multiprocess
def test_a_dtensor_is_converted_where_a_whole_tensor_goes_and_refused_inside_trees(dist_pool):
    for result in dist_pool.run(_dtensors_where_tensors_go, timeout=60):
        assert result[:3] == [True, True, True]
        in_tree, from_src, with_backend = result[3:]
        assert "is a torch DTensor, whose data lives on its mesh's ranks: convert it on every rank" in in_tree
        assert "fshard.from_dtensor(dt)" in in_tree
        assert "shard(..., src=0) got a torch DTensor on rank 0" in from_src
        assert "shard() got a torch DTensor together with backend=" in with_backend


def _dtensor_errors() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh("cpu", (2, 2))
    partial = DTensor.from_local(torch.ones(2, 3), mesh, [Partial("avg"), Shard(0)], run_check=False)
    boxes = fshard.shard(
        X, fshard.Explicit([((0, 0), (7, 5), 3), ((0, 5), (7, 7), 1), ((7, 0), (3, 12), 0), ((7, 0), (3, 12), 2)])
    )
    two_per_rank = fshard.shard(X, fshard.Chunk(0, [0, 1, 2, 3, 0, 1, 2, 3]))
    return _spec_errors(
        lambda: fshard.from_dtensor(partial),
        lambda: fshard.to_dtensor(boxes, MESH),
        lambda: fshard.to_dtensor(two_per_rank, MESH),
        lambda: fshard.to_dtensor(fshard.shard(X, fshard.Chunk(0, ALL)), "mesh"),
    )


@pytest.mark.multiprocess
def test_what_dtensor_cannot_express_raises_naming_why(dist_pool):
    partial, boxes, two, not_a_mesh = dist_pool.run(_dtensor_errors)[0]
    assert "Partial" in partial
    assert "is a pending 'avg' reduction that fshard does not hold" in partial
    assert "dt.redistribute(dt.device_mesh, [Replicate(), Shard(dim=0)])" in partial
    assert "DTensor cannot express" in boxes
    assert "one box per mesh position" in boxes
    assert "fshard.reshard" in boxes
    assert "DTensor cannot express" in two
    assert "needs an fshard.Mesh or a torch DeviceMesh, got str" in not_a_mesh


@pytest.mark.parametrize("convert", [fshard.to_sharded_tensor, lambda x: fshard.to_dtensor(x, MESH)], ids=["st", "dt"])
def test_local_arrays_are_refused_with_the_fix(convert):
    x = fshard.shard(X, fshard.Chunk(0, ALL))
    with pytest.raises(fshard.SpecError, match=r"needs an array on the torch_dist backend.*got one on 'local'"):
        convert(x)


# -- pending reductions: DTensor's Partial placements ----------------------------------------

EXACT = torch.arange(120.0).reshape(10, 12)  # integers: every order of a sum gives the same bits


def _dtensor_partial_cases(mesh: object) -> list[tuple[list, torch.Tensor, fshard.Partial]]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    rank = dist.get_rank()
    dp, tp = divmod(rank, 2)
    named = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
    return [
        # sum over tp, replicated over dp
        ([Replicate(), Partial()], EXACT * (tp + 1), fshard.Partial(fshard.Named(named, (None,)), over="tp")),
        # rows split over dp, sum over tp
        ([Shard(0), Partial()], EXACT.chunk(2)[dp] * (tp + 1), fshard.Partial(fshard.Named(named, ("dp",)), over="tp")),
        # every copy a summand
        ([Partial(), Partial()], EXACT * (rank + 1), fshard.Partial(fshard.Named(named, (None,)))),
        # a max over dp, columns split over tp
        (
            [Partial("max"), Shard(1)],
            EXACT.chunk(2, dim=1)[tp] * (dp + 1),
            fshard.Partial(fshard.Named(named, (None, "tp")), "max", over="dp"),
        ),
    ]


def _dtensor_partial_round_trips() -> list[tuple[bool, bool, bool, bool]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = []
    for placements, local, spec in _dtensor_partial_cases(mesh):
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=EXACT.shape, stride=EXACT.stride())
        x = fshard.from_dtensor(dt)
        back = fshard.to_dtensor(x, mesh)
        out.append(
            (
                x.layout == spec.layout(tuple(EXACT.shape)),
                torch.equal(fshard.gather(x), dt.full_tensor()),
                tuple(back.placements) == tuple(dt.placements),
                torch.equal(back.to_local(), local) and torch.equal(back.full_tensor(), dt.full_tensor()),
            )
        )
    return out


@pytest.mark.multiprocess
def test_partial_placements_round_trip_as_pending_reductions(dist_pool):
    assert dist_pool.run(_dtensor_partial_round_trips) == [[(True, True, True, True)] * 4] * 4


def _crossed_summands_error() -> str:
    # Summands {0, 3} and {1, 2}: not along one mesh axis.
    layout = fshard.Layout((2, 3), [((0, 0), (2, 3), r) for r in ALL], "sum", terms=[0, 1, 1, 0])
    shard = fshard.Shard(layout.shards[dist.get_rank()], torch.ones(2, 3))
    crossed = fshard.from_local_shards_and_layout([shard], layout)
    try:
        fshard.to_dtensor(crossed, MESH)
    except fshard.SpecError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_summands_not_along_mesh_axes_raise_naming_the_fix(dist_pool):
    message = dist_pool.run(_crossed_summands_error)[0]
    assert "DTensor cannot express" in message
    assert "summands of a pending reduction along whole mesh axes (Partial)" in message
    assert "Reshard first: fshard.reshard(x, fshard.Named(mesh, partition))" in message


def _chunk_with_an_empty_last_box_to_dtensor() -> list[object]:
    """Chunk puts the empty last box of 5 columns over 4 ranks at column 6, DTensor's Shard(1) at column 5."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(50.0).reshape(10, 5)
    dt = fshard.to_dtensor(fshard.shard(full, fshard.Chunk(1, ALL)), mesh)
    return [str(dt.placements), tuple(dt.to_local().shape), torch.equal(dt.full_tensor(), full)]


@pytest.mark.multiprocess
def test_a_chunk_whose_last_box_is_empty_is_dtensors_shard(dist_pool):
    got = dist_pool.run(_chunk_with_an_empty_last_box_to_dtensor)
    assert [r[1] for r in got] == [(10, 2), (10, 2), (10, 1), (10, 0)]
    assert all(r[0] == "(Shard(dim=1),)" and r[2] for r in got), got


def _from_a_dtensor_on_a_sub_mesh() -> list[str]:
    """Every rank calls from_dtensor on a DTensor of the 1-D mesh over ranks 0 and 1, and from_sharded_tensor on it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dt = distribute_tensor(torch.arange(10.0), DeviceMesh("cpu", torch.tensor([0, 1])), [Shard(0)])
    out = []
    try:
        x = fshard.from_dtensor(dt)
        out.append(str([t.tolist() for t in x.addressable_data]))
    except fshard.SpecError as exc:
        out.append(str(exc))
    try:
        fshard.from_sharded_tensor(dt)
    except TypeError as exc:
        out.append(str(exc))
    return out


@pytest.mark.multiprocess
def test_from_dtensor_off_its_sub_mesh_names_the_fix(dist_pool):
    """Before, the ranks outside the mesh raised torch's IndexError from inside ``get_group``."""
    got = dist_pool.run(_from_a_dtensor_on_a_sub_mesh)
    assert [r[0] for r in got[:2]] == ["[[0.0, 1.0, 2.0, 3.0, 4.0]]", "[[5.0, 6.0, 7.0, 8.0, 9.0]]"]
    for rank in (2, 3):
        assert got[rank][0] == (
            f"from_dtensor() on rank {rank}, which is not in the DTensor's mesh (ranks [0, 1]): call it on the mesh's "
            "ranks only (where dt.device_mesh.get_coordinate() is not None)."
        )
    assert {r[1] for r in got} == {
        "from_sharded_tensor() takes a torch ShardedTensor, got a DTensor: use fshard.from_dtensor(dt)."
    }
