"""torch DCP folders written by ``dcp.save`` on 4 Gloo processes, read by ``fshard.load`` on 1, 2, 3 and 4 ranks.

The state dict holds DTensors (uneven sizes, a 1-D and a 2-D mesh, replicas), a
ShardedTensor (with an empty trailing shard), a 0-d tensor and a non-tensor entry.
Every value must come back bit-identical to the dense tensor it was made from, and a
replicated box must be read from storage once per job.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard._checkpoint import _dcp, _dcp_exchange
from fshard.backends.local import LOCAL
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

ALL = [0, 1, 2, 3]
_G = torch.Generator().manual_seed(7)
DENSE = {
    "model.rows": torch.randn(10, 7, generator=_G),  # Shard(0) on 4 ranks: 3, 3, 3, 1 rows
    "model.grid": torch.randn(7, 5, generator=_G).to(torch.bfloat16),  # [Shard(0), Shard(1)] on a 2x2 mesh
    "model.cols": torch.randn(6, 9, generator=_G),  # [Replicate(), Shard(1)] on a 2x2 mesh
    "model.bias": torch.randn(5, generator=_G).to(torch.float64),  # Replicate()
    "model.scale": torch.tensor(2.5),  # 0-d
    "optim.st": torch.arange(36, dtype=torch.int32).reshape(9, 4),  # ShardedTensor, Chunk(0) on 4 ranks: 3,3,3,0
}
SPECS_2D = {"model.rows": 2, "model.grid": 2, "model.cols": 2, "model.bias": 1, "model.scale": 0, "optim.st": 2}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _state_dict() -> dict[str, object]:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    line, grid = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    st = sharded_tensor.empty(ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in ALL]), 9, 4, dtype=torch.int32)
    for s in st.local_shards():
        o, n = s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]
        s.tensor.copy_(DENSE["optim.st"][o : o + n])
    model = {
        "rows": distribute_tensor(DENSE["model.rows"], line, [Shard(0)]),
        "grid": distribute_tensor(DENSE["model.grid"], grid, [Shard(0), Shard(1)]),
        "cols": distribute_tensor(DENSE["model.cols"], grid, [Replicate(), Shard(1)]),
        "bias": distribute_tensor(DENSE["model.bias"], line, [Replicate()]),
        "scale": DENSE["model.scale"].clone(),
    }
    return {"model": model, "optim": {"st": st}, "step": 1234}


def _dcp_save(path: str) -> None:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", category=FutureWarning)
    dcp.save(_state_dict(), checkpoint_id=path)


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dcp") / "ck")
    dist_pool.run(_dcp_save, path, timeout=120)
    return path


def _targets(ranks: list[int]) -> dict[str, dict[str, object]]:
    """Named sets of target specs over ``ranks``."""
    n = len(ranks)
    mesh = fshard.Mesh((n,), ranks=ranks)
    return {
        "rows": {k: fshard.Chunk(0, ranks) for k, d in SPECS_2D.items() if d},
        "cols-and-replicas": {
            **{k: fshard.Chunk(-1, ranks[::-1]) for k, d in SPECS_2D.items() if d},
            "model.scale": fshard.Replicated(ranks),
            "model.bias": fshard.Replicated(ranks),
        },
        "named": {k: fshard.Named(mesh, ("x", None) if d == 2 else (None,) * d) for k, d in SPECS_2D.items()},
        "single": {k: fshard.Single(ranks[-1]) for k in SPECS_2D},
    }


def _layout(spec: object, shape: torch.Size) -> fshard.Layout:
    return spec if isinstance(spec, fshard.Layout) else spec.layout(tuple(shape))  # type: ignore[attr-defined]


def _check(out: dict[str, object], specs: dict[str, object]) -> list[str]:
    """Names whose values or layouts are wrong (gathers are collective: every rank calls each)."""
    bad = []
    for name, spec in specs.items():
        x = out[name]
        assert isinstance(x, fshard.ShardedArray)
        if x.layout != _layout(spec, DENSE[name].shape) or not _same(fshard.gather(x), DENSE[name]):
            bad.append(name)
    return bad


def test_local_backend_reads_a_four_rank_dcp_folder(saved):
    plain = fshard.load(saved)
    assert sorted(plain) == sorted([*DENSE, "step"])  # in the order DCP's metadata lists them
    assert all(_same(plain[k], v) for k, v in DENSE.items())
    assert isinstance(plain["step"], bytes)
    for ranks in ([0], [0, 1], [2, 0, 1]):
        for specs in _targets(ranks).values():
            assert _check(fshard.load(saved, specs=specs, backend=LOCAL), specs) == []


def _load_on(path: str, ranks: list[int]) -> dict[str, list[str]] | None:
    group = dist.new_group(ranks) if len(ranks) < 4 else None
    if dist.get_rank() not in ranks:
        return None
    backend = TorchDistBackend(group)
    out = {}
    for what, specs in _targets(ranks).items():
        out[what] = _check(fshard.load(path, specs=specs, backend=backend), specs)
    plain = fshard.load(path, backend=backend)  # plain tensors on every rank, each byte read once
    out["plain"] = [k for k, v in DENSE.items() if not _same(plain[k], v)]
    return out


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [1, 3], [0, 2, 3]], ids=["4-ranks", "2-ranks", "3-ranks"])
def test_torch_dist_reads_a_four_rank_dcp_folder(dist_pool, saved, ranks):
    results = dist_pool.run(_load_on, saved, ranks, timeout=180)
    for k, r in enumerate(results):
        assert r == (None if k not in ranks else {what: [] for what in [*_targets(ranks), "plain"]})


def _count_reads(path: str, spec_name: str) -> tuple[int, list[str]]:
    """Elements this rank read from storage while loading into ``spec_name`` targets."""
    read = []
    real = _dcp.read_box

    def counting(files, stored, lo, size, out):
        read.append(out.numel())
        return real(files, stored, lo, size, out)

    _dcp.read_box = counting  # type: ignore[assignment]
    try:
        specs = {
            "replicated": dict.fromkeys(SPECS_2D, fshard.Replicated(ALL)),
            "saved": {"model.rows": fshard.Chunk(0, ALL), "optim.st": fshard.Chunk(0, ALL)},
        }[spec_name]
        out = fshard.load(path, specs=specs)
    finally:
        _dcp.read_box = real  # type: ignore[assignment]
    return sum(read), _check(out, specs)


def test_a_replicated_box_is_read_from_storage_once_per_job(dist_pool, saved):
    results = dist_pool.run(_count_reads, saved, "replicated", timeout=120)
    assert [bad for _, bad in results] == [[]] * 4
    assert sum(n for n, _ in results) == sum(t.numel() for t in DENSE.values())
    assert all(n > 0 for n, _ in results)  # every holder shares the reading


def test_each_rank_reads_only_its_own_boxes(dist_pool, saved):
    results = dist_pool.run(_count_reads, saved, "saved", timeout=120)
    assert [bad for _, bad in results] == [[]] * 4
    assert [n for n, _ in results] == [3 * 7 + 3 * 4, 3 * 7 + 3 * 4, 3 * 7 + 3 * 4, 1 * 7]


def _load_in_small_batches(path: str) -> tuple[int, list[str]]:
    """(reshards of the byte space, wrong names) with batches of about 64 replicated bytes."""
    calls = []
    real_limit, real_reshard = _dcp.EXCHANGE_BYTES, _dcp_exchange.reshard
    _dcp.EXCHANGE_BYTES = 64
    _dcp_exchange.reshard = lambda *a: calls.append(1) or real_reshard(*a)  # type: ignore[assignment]
    try:
        specs = {k: fshard.Named(fshard.Mesh((2, 2)), (None,) * d) for k, d in SPECS_2D.items()}  # all replicated
        out = fshard.load(path, specs=specs)
    finally:
        _dcp.EXCHANGE_BYTES, _dcp_exchange.reshard = real_limit, real_reshard  # type: ignore[assignment]
    return len(calls), _check(out, specs)


def test_replicated_boxes_move_in_batches(dist_pool, saved):
    results = dist_pool.run(_load_in_small_batches, saved, timeout=120)
    assert [bad for _, bad in results] == [[]] * 4
    calls = {n for n, _ in results}
    assert len(calls) == 1  # every rank joins every batch's reshard
    assert 4 <= calls.pop() <= len(SPECS_2D)  # four of the six tensors hold over 64 bytes: a batch each at least


def _load_like(path: str) -> list[bool]:
    rank = dist.get_rank()
    like = {
        "model.grid": fshard.zeros(fshard.Chunk(1, [3, 1]), 7, 5, dtype=torch.bfloat16),
        "model.scale": torch.zeros(()),
        "step": None,
    }
    out = fshard.load(path, like=like)
    return [
        sorted(out) == ["model.grid", "model.scale", "step"],
        out["model.grid"].layout == like["model.grid"].layout,
        _same(fshard.gather(out["model.grid"]), DENSE["model.grid"]),
        _same(out["model.scale"], DENSE["model.scale"]),
        isinstance(out["step"], bytes) and out["step"][:2] == b"PK",
        rank >= 0,
    ]


def test_like_gives_layouts_and_plain_tensors_on_four_ranks(dist_pool, saved):
    assert dist_pool.run(_load_like, saved, timeout=120) == [[True] * 6] * 4


def _load_expecting_error(path: str, names: list[str]) -> str:
    try:
        fshard.load(path, specs=dict.fromkeys(names, fshard.Chunk(0, ALL)))
    except (fshard.CheckpointError, fshard.SpecError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_file_damaged_on_one_rank_raises_on_every_rank(dist_pool, saved, tmp_path):
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(saved, copy)
    (copy / "__3_0.distcp").write_bytes(b"")  # rank 3 reads the last rows of model.rows from it
    errors = dist_pool.run(_load_expecting_error, str(copy), ["model.rows"], timeout=120)
    assert errors[3].startswith("CheckpointError: DCP file ")
    assert "__3_0.distcp" in errors[3]
    assert "truncated" in errors[3]
    assert all(e.startswith("CheckpointError: fshard.load failed on rank 3: CheckpointError") for e in errors[:3])
