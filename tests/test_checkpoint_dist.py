"""Checkpoints under torch_dist on 4 Gloo processes: save on 4 ranks, load on 1, 2, 3 or 4.

Every rank writes only its own file and reads only what its target shards need;
the local backend reads what the pool wrote, and the pool reads what it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard._checkpoint import _reader, _write
from fshard.backends.local import LOCAL
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

ALL = [0, 1, 2, 3]
SHAPE = (10, 12)
X = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
W = torch.arange(24, dtype=torch.int32).reshape(4, 6)

SAVED = {
    "rows": fshard.Chunk(0, ALL),
    "grid": fshard.Named(fshard.Mesh((2, 2)), ("x", "y")),
    "replicas": fshard.Named(fshard.Mesh((2, 2)), (None, "y")),
}
# Each target on 1, 2 or 3 of the 4 ranks (the others hold nothing but still call load).
TARGETS = [
    fshard.Single(2),
    fshard.Chunk(1, [3, 0]),
    fshard.Explicit([((0, 0), (4, 12), 1), ((4, 0), (6, 5), 0), ((4, 5), (6, 7), 3)]),
    fshard.Replicated([0, 1, 2]),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _save(path: str, saved: str) -> list[str]:
    """Saves X in a 4-rank layout plus a plain tensor and a scalar; returns the files present afterwards."""
    tree = {"x": fshard.shard(X, SAVED[saved]), "w": W, "step": 11}
    fshard.save(path, tree)
    index = json.loads((Path(path) / "index.json").read_text())
    return sorted(p.name for p in (Path(path) / index["data"]).iterdir())


def _load_all_targets(path: str) -> list[bool]:
    ok = []
    for spec in TARGETS:
        for verify in (True, False):
            out = fshard.load(path, specs={"x": spec, "w": fshard.Chunk(0, [1, 2]), "step": None}, verify=verify)
            ok.append(out["x"].layout == spec.layout(SHAPE) and out["step"] == 11)
            x, w = fshard.gather(out["x"]), fshard.gather(out["w"])  # collectives: every rank calls both
            ok.append(_same(x, X) and _same(w, W))
    return ok


@pytest.mark.parametrize("saved", sorted(SAVED))
def test_save_on_four_ranks_load_on_one_two_three_and_four(dist_pool, tmp_path, saved):
    path = str(tmp_path / "ck")
    files = dist_pool.run(_save, path, saved)
    assert all(f == files[0] for f in files)
    assert set(files[0]) <= {f"rank-0000{r}.safetensors" for r in ALL}
    assert all(all(r) for r in dist_pool.run(_load_all_targets, path))
    # The local backend (this process, no process group) reads the same files.
    out = fshard.load(path, specs={"x": fshard.Chunk(0, [0, 1, 2]), "w": None, "step": None}, backend=LOCAL)
    assert _same(fshard.gather(out["x"]), X)
    assert _same(out["w"], W)


def _load_on_subgroup(path: str, ranks: list[int]) -> bool | None:
    group = dist.new_group(ranks)  # every rank creates the group; only its members load
    if dist.get_rank() not in ranks:
        return None
    backend = TorchDistBackend(group)
    out = fshard.load(path, specs={"x": fshard.Chunk(1, ranks), "w": None, "step": None}, backend=backend)
    return _same(fshard.gather(out["x"]), X) and _same(out["w"], W) and out["step"] == 11


@pytest.mark.parametrize("ranks", [[0], [1, 3], [0, 1, 2]], ids=["1-rank", "2-ranks", "3-ranks"])
def test_load_on_a_smaller_group(dist_pool, tmp_path, ranks):
    path = str(tmp_path / "ck")
    dist_pool.run(_save, path, "grid")
    results = dist_pool.run(_load_on_subgroup, path, ranks)
    assert [r for k, r in enumerate(results) if k in ranks] == [True] * len(ranks)


def _load_counting_reads(path: str) -> tuple[int, int, bool]:
    read = []
    part = _reader.Reader.part
    _reader.Reader.part = lambda self, *a: read.append(t := part(self, *a)) or t  # type: ignore[method-assign]
    try:
        spec = fshard.Chunk(1, [2, 3, 0, 1])
        out = fshard.load(path, specs={"x": spec, "w": None, "step": None}, verify=False)
    finally:
        _reader.Reader.part = part  # type: ignore[method-assign]
    mine = sum(s.data.numel() for s in out["x"].addressable_shards)
    return sum(t.numel() for t in read) - W.numel(), mine, _same(fshard.gather(out["x"]), X)


def test_each_rank_reads_only_what_its_shards_need(dist_pool, tmp_path):
    path = str(tmp_path / "ck")
    dist_pool.run(_save, path, "rows")
    for read, mine, same in dist_pool.run(_load_counting_reads, path):
        assert read == mine
        assert same


def _load_expecting_error(path: str) -> str:
    try:
        fshard.load(path, specs={"x": fshard.Chunk(0, ALL), "w": None, "step": None})
    except fshard.CheckpointError as exc:
        return str(exc)
    return "no error"


def test_damage_seen_by_one_rank_raises_on_every_rank(dist_pool, tmp_path):
    path = tmp_path / "ck"
    dist_pool.run(_save, str(path), "rows")
    index = json.loads((path / "index.json").read_text())
    target = path / index["data"] / "rank-00002.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 1
    target.write_bytes(bytes(data))
    errors = dist_pool.run(_load_expecting_error, str(path))
    assert "rank-00002.safetensors" in errors[2]
    assert "sha256" in errors[2]
    for k in (0, 1, 3):  # ranks whose own reads were fine
        assert errors[k].startswith("fshard.load failed on rank 2: CheckpointError")
        assert "sha256" in errors[k]


def _save_crashing_on_rank_one(path: str) -> str:
    real = _write.save_file

    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    if dist.get_rank() == 1:
        _write.save_file = crash
    try:
        fshard.save(path, {"x": fshard.shard(X + 1, fshard.Chunk(0, ALL)), "w": W, "step": 12})
    except (OSError, fshard.CheckpointError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        _write.save_file = real
    return "saved"


def test_a_rank_failing_mid_save_fails_every_rank_and_keeps_the_old_checkpoint(dist_pool, tmp_path):
    path = tmp_path / "ck"
    dist_pool.run(_save, str(path), "replicas")
    errors = dist_pool.run(_save_crashing_on_rank_one, str(path))
    assert errors[1].startswith(f"CheckpointError: Saving checkpoint {path} failed writing {path}/data.")
    assert "rank-00001.safetensors: disk full (injected). Nothing was committed" in errors[1]
    assert all(e.startswith("CheckpointError: fshard.save failed on rank 1: CheckpointError") for e in errors[::2])
    out = fshard.load(path, backend=LOCAL)
    assert _same(fshard.gather(out["x"]), X)
    assert out["step"] == 11
    assert sorted(p.name.split(".")[0] for p in path.iterdir()) == ["data", "index"]


def _load_local_checkpoint(path: str) -> bool:
    out = fshard.load(path, like={"x": fshard.zeros(fshard.Chunk(0, [3, 2, 1, 0]), *SHAPE), "w": W, "step": 0})
    return _same(fshard.gather(out["x"]), X) and out["step"] == 11


def test_a_local_checkpoint_loads_on_four_ranks(dist_pool, tmp_path):
    path = str(tmp_path / "ck")
    fshard.save(path, {"x": fshard.shard(X, fshard.Chunk(1, [0, 1, 2, 3, 4, 5])), "w": W, "step": 11})
    assert dist_pool.run(_load_local_checkpoint, path) == [True] * 4


# -- ranks that disagree: every rank raises before anything is written -------------------------


def _save_expecting_error(path_by_rank: list[str], tree_kind: str) -> str:
    rank = dist.get_rank()
    trees = {
        "same": {"x": fshard.shard(X, SAVED["rows"]), "step": 12},
        "opt-state": {"x": fshard.shard(X, SAVED["rows"]), "opt": {"m": torch.full((3,), float(rank))}, "step": 12},
        "scalar": {"x": fshard.shard(X, SAVED["rows"]), "step": 12 + (rank == 2)},
        "partial": {"x": fshard.shard(X, fshard.Partial(fshard.Replicated(ALL))), "step": 12},
    }
    try:
        fshard.save(path_by_rank[rank], trees[tree_kind])
    except (fshard.CheckpointError, fshard.SpecError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def _old_checkpoint_intact(path: Path) -> None:
    out = fshard.load(path, backend=LOCAL)
    assert _same(fshard.gather(out["x"]), X)
    assert out["step"] == 11
    assert sorted(p.name.split(".")[0] for p in path.iterdir()) == ["data", "index"]


def test_different_paths_on_different_ranks_raise_everywhere_and_keep_the_old_checkpoint(dist_pool, tmp_path):
    path = tmp_path / "ck"
    dist_pool.run(_save, str(path), "rows")
    paths = [str(path)] + [str(tmp_path / f"ck-{r}") for r in (1, 2, 3)]  # a timestamp taken on each rank
    errors = dist_pool.run(_save_expecting_error, paths, "same")
    assert len(set(errors)) == 1
    assert errors[0].startswith("CheckpointError: fshard.save was given different paths on different ranks")
    assert f"rank 0: {path}, rank 1: {tmp_path / 'ck-1'}" in errors[0]
    assert "broadcast_object_list" in errors[0]
    _old_checkpoint_intact(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_per_rank_plain_tensors_raise_everywhere_naming_the_leaf_and_the_fix(dist_pool, tmp_path):
    path = tmp_path / "ck"
    dist_pool.run(_save, str(path), "rows")
    errors = dist_pool.run(_save_expecting_error, [str(path)] * 4, "opt-state")
    assert len(set(errors)) == 1
    assert errors[0].startswith("CheckpointError: Plain tensor at ['opt']['m'] differs between ranks (rank 0 has ")
    assert "fshard.from_local_tensor(t.unsqueeze(0))" in errors[0]
    _old_checkpoint_intact(path)


def test_per_rank_scalars_raise_everywhere(dist_pool, tmp_path):
    path = tmp_path / "ck"
    dist_pool.run(_save, str(path), "rows")
    errors = dist_pool.run(_save_expecting_error, [str(path)] * 4, "scalar")
    assert len(set(errors)) == 1
    assert "Leaf at ['step'] differs between ranks (rank 0 has int 12, rank 2 has int 13)" in errors[0]
    _old_checkpoint_intact(path)


def test_a_partial_array_raises_the_same_spec_error_on_every_rank(dist_pool, tmp_path):
    path = tmp_path / "ck"
    dist_pool.run(_save, str(path), "rows")
    errors = dist_pool.run(_save_expecting_error, [str(path)] * 4, "partial")
    assert len(set(errors)) == 1
    assert errors[0].startswith("SpecError: ShardedArray at ['x'] has a pending sum")
    assert "Reshard it to a non-partial spec first" in errors[0]
    _old_checkpoint_intact(path)


def _save_per_rank_state_as_arrays(path: str) -> list[float]:
    rank = dist.get_rank()
    m = torch.full((3,), float(rank))
    fshard.save(path, {"opt": {"m": fshard.from_local_tensor(m.unsqueeze(0))}})
    out = fshard.load(path, specs={"opt": {"m": fshard.Chunk(0, ALL)}})
    return out["opt"]["m"].local_tensor()[0].tolist()


def test_per_rank_state_wrapped_as_arrays_round_trips(dist_pool, tmp_path):
    rows = dist_pool.run(_save_per_rank_state_as_arrays, str(tmp_path / "ck"))
    assert rows == [[float(r)] * 3 for r in ALL]
