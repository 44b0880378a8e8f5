"""Hugging Face checkpoints on 4 Gloo processes: each box read once per job, files written by different ranks.

Summed over the ranks, the bytes read from disk equal the distinct target boxes' bytes:
a replicated box is read by one of its holders and sent to the others.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import fshard
from fshard._checkpoint import _hf_direct, _hf_save, _safetensors

pytestmark = pytest.mark.multiprocess

ALL = [0, 1, 2, 3]
TIMEOUT = 120
G = torch.Generator().manual_seed(3)
TENSORS = {
    "a": torch.randn(13, 7, generator=G),
    "b": torch.randn(6, 10, generator=G).to(torch.bfloat16),
    "c": torch.arange(9, dtype=torch.int32),
    "d": torch.randn(4, 5, 3, generator=G),
}
SPECS = {
    "a": fshard.Chunk(0, ALL),
    "b": fshard.Chunk(1, ALL),
    "c": fshard.Replicated(ALL),
    "d": fshard.Named(fshard.Mesh((2, 2)), (None, "x", None)),  # replicated over y
}


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _distinct_bytes(specs: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    total = 0
    for name, spec in specs.items():
        layout = spec.layout(tuple(tensors[name].shape))
        boxes = {(s.offsets, s.sizes) for s in layout.shards if s.numel}
        total += sum(math.prod(sz) for _, sz in boxes) * tensors[name].dtype.itemsize
    return total


def _load(path: str, specs: dict[str, Any]) -> dict[str, Any]:
    _safetensors.counters.reset()
    out = fshard.load(path, specs=specs)
    read = _safetensors.counters.bytes_read
    mine = sum(t.nbytes for x in out.values() for t in x.addressable_data)
    return {"read": read, "mine": mine, "sha": {n: _sha(fshard.gather(x)) for n, x in out.items()}}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    save_file(dict(list(TENSORS.items())[:2]), tmp_path / "model-00001-of-00002.safetensors")
    save_file(dict(list(TENSORS.items())[2:]), tmp_path / "model-00002-of-00002.safetensors")
    names = {n: f"model-0000{1 + (k >= 2)}-of-00002.safetensors" for k, n in enumerate(TENSORS)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return tmp_path


def test_every_box_is_read_once_per_job(dist_pool: Any, folder: Path) -> None:
    results = dist_pool.run(_load, str(folder), SPECS, timeout=TIMEOUT)
    assert all(r["sha"] == {n: _sha(t) for n, t in TENSORS.items()} for r in results)
    assert sum(r["read"] for r in results) == _distinct_bytes(SPECS, TENSORS)
    assert [r["read"] for r in results] != [r["mine"] for r in results]  # replicas came by message, not from disk


def test_a_replicated_spec_reads_one_copy_balanced_over_the_ranks(dist_pool: Any, tmp_path: Path) -> None:
    tensors = {f"w{k}": torch.full((16, 16), float(k)) for k in range(8)}
    save_file(tensors, tmp_path / "model.safetensors")
    results = dist_pool.run(
        _load, str(tmp_path / "model.safetensors"), dict.fromkeys(tensors, fshard.Replicated(ALL)), timeout=TIMEOUT
    )
    assert [r["read"] for r in results] == [2 * 16 * 16 * 4] * 4  # one copy in all, two tensors per rank
    assert all(r["sha"] == {n: _sha(t) for n, t in tensors.items()} for r in results)


def _load_fused(path: str) -> dict[str, Any]:
    fuse = [fshard.Split("a", 0, {"q": 5, "k": 4, "v": 4}), fshard.Concat(["k", "v"], 0, "kv")]
    _safetensors.counters.reset()
    out = fshard.load(path, specs={"q": fshard.Chunk(1, ALL), "kv": fshard.Chunk(0, [3, 1])}, fuse=fuse)
    return {
        "read": _safetensors.counters.bytes_read,
        "q": _sha(fshard.gather(out["q"])),
        "kv": _sha(fshard.gather(out["kv"])),
    }


def test_split_and_concat_across_ranks_read_each_byte_once(dist_pool: Any, folder: Path) -> None:
    results = dist_pool.run(_load_fused, str(folder), timeout=TIMEOUT)
    a = TENSORS["a"]
    assert all((r["q"], r["kv"]) == (_sha(a[:5]), _sha(a[5:])) for r in results)
    assert sum(r["read"] for r in results) == a.nbytes


def _load_with_one_rank_failing(path: str) -> str:
    def spec(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        if dist.get_rank() == 2:
            raise fshard.CheckpointError("injected on rank 2")
        return fshard.Chunk(0, ALL)

    try:
        fshard.load(path, specs=spec)
    except fshard.CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_a_failure_on_one_rank_raises_on_every_rank(dist_pool: Any, folder: Path) -> None:
    errors = dist_pool.run(_load_with_one_rank_failing, str(folder), timeout=TIMEOUT)
    assert errors[2] == "injected on rank 2"
    assert all(
        e == "fshard.load failed on rank 2: CheckpointError: injected on rank 2" for e in errors[::3] + errors[1:2]
    )


def _load_different_specs(path: str) -> str:
    spec = fshard.Chunk(0, ALL if dist.get_rank() else ALL[::-1])
    try:
        fshard.load(path, specs={"a": spec})
    except (fshard.CheckpointError, fshard.CollectiveMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_ranks_asking_for_different_layouts_all_raise(dist_pool: Any, folder: Path) -> None:
    errors = dist_pool.run(_load_different_specs, str(folder), timeout=TIMEOUT)
    if fshard.config().check_collectives or os.environ.get("FSHARD_CHECK") == "1":  # check mode finds it first
        assert all(e.startswith("CollectiveMismatchError: Ranks called different collectives") for e in errors)
    else:
        assert all(e.startswith("CheckpointError: fshard.load of ") for e in errors)
        assert all("the ranks read different checkpoints or targets" in e for e in errors)


# -- save_safetensors from 4 ranks ----------------------------------------------------------------


def _save(path: str, max_shard_size: Any) -> tuple[list[str], list[str], int]:
    """The folder's files after the save, those this rank created, and the data bytes this rank wrote."""
    tree = {n: fshard.shard(t, SPECS[n]) for n, t in TENSORS.items()}
    tree["plain"] = torch.arange(5.0)  # one value that every rank holds
    mine: list[str] = []
    data = [0]
    real_create, real_write = _hf_save.create_files, _hf_direct.write_runs

    def create(files: Any, names: Any, writers: Any, *args: Any) -> None:
        mine.extend(n for n, w in zip(names, writers) if w == dist.get_rank())
        real_create(files, names, writers, *args)

    def write(fd: int, base: int, spans: Any, buf: Any) -> None:
        data[0] += int(spans[2].sum()) if base else 0  # a box's runs (the header goes at base 0)
        real_write(fd, base, spans, buf)

    _hf_save.create_files, _hf_direct.write_runs = create, write  # type: ignore[assignment]
    try:
        fshard.save_safetensors(path, tree, max_shard_size=max_shard_size)
    finally:
        _hf_save.create_files, _hf_direct.write_runs = real_create, real_write  # type: ignore[assignment]
    return sorted(p.name for p in Path(path).iterdir()), mine, data[0]


@pytest.mark.parametrize("max_shard_size", [100, 40, "5GB"], ids=["four-files", "five-files", "one-file"])
def test_save_from_four_ranks_reads_back_with_safetensors(dist_pool: Any, tmp_path: Path, max_shard_size: Any) -> None:
    path = tmp_path / "hf"
    listings, created, data = zip(*dist_pool.run(_save, str(path), max_shard_size, timeout=TIMEOUT))
    assert all(files == listings[0] for files in listings)
    assert sorted(n for w in created for n in w) == [n for n in listings[0] if n.endswith(".safetensors")]
    expected = {**TENSORS, "plain": torch.arange(5.0)}
    merged: dict[str, torch.Tensor] = {}
    for name in listings[0]:
        if name.endswith(".safetensors"):
            merged |= load_file(path / name)
    assert {n: _sha(merged[n]) for n in expected} == {n: _sha(t) for n, t in expected.items()}
    # Every data byte written once, by the rank that holds it: nothing else crossed ranks.
    assert sum(data) == sum(t.numel() * t.element_size() for t in expected.values())
    assert all(d > 0 for d in data)
    if max_shard_size == 100:
        assert len(listings[0]) == 5
        assert "model.safetensors.index.json" in listings[0]
        assert [len(w) for w in created] == [1, 1, 1, 1]  # four files, created by four ranks
    elif max_shard_size == 40:
        assert [len(w) for w in created] == [1, 1, 1, 2]  # five files: rank 3 creates two
    else:
        assert listings[0] == ["model.safetensors"]
        save_file(expected, tmp_path / "ref.safetensors", metadata={"format": "pt"})
        assert (path / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["hf", *(["ref.safetensors"] if max_shard_size == "5GB" else [])]
    )


def _save_failing_on_rank_one(path: str, max_shard_size: int) -> str:
    real = _hf_direct.write_runs
    calls = []

    def broken(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 2:  # the first write went well
            raise OSError(28, "No space left on device")
        real(*args)

    if dist.get_rank() == 1:
        _hf_direct.write_runs = broken  # type: ignore[assignment]
    try:
        _save(path, max_shard_size)
    except fshard.CheckpointError as exc:
        return str(exc)
    finally:
        _hf_direct.write_runs = real  # type: ignore[assignment]
    return "saved"


@pytest.mark.parametrize("max_shard_size", [100, 40], ids=["four-files", "five-files"])
def test_a_rank_failing_mid_save_fails_every_rank_and_leaves_nothing(
    dist_pool: Any, tmp_path: Path, max_shard_size: int
) -> None:
    errors = dist_pool.run(_save_failing_on_rank_one, str(tmp_path / "hf"), max_shard_size, timeout=TIMEOUT)
    assert re.search(r"failed at .*model-\d{5}-of-\d{5}\.safetensors: No space left on device", errors[1])
    assert all(e.startswith("fshard.save_safetensors failed on rank 1: CheckpointError") for e in errors[::2])
    assert list(tmp_path.iterdir()) == []


def _save_with_own_limit(path: str) -> str:
    """Rank 0 would split the files at 100 bytes, the others at 40: each plans other files of the same names."""
    try:
        _save(path, 100 if dist.get_rank() == 0 else 40)
    except fshard.CheckpointError as exc:
        return str(exc)
    return "saved"


def test_ranks_given_different_max_shard_sizes_all_raise_and_keep_the_folder(dist_pool: Any, tmp_path: Path) -> None:
    """Each rank wrote its boxes at its own plan's offsets into files another rank's plan made: a folder that no
    reader could load replaced the good one, and every rank returned."""
    path = tmp_path / "hf"
    fshard.save_safetensors(path, TENSORS)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    errors = dist_pool.run(_save_with_own_limit, str(path), timeout=TIMEOUT)
    msg = "fshard.save_safetensors was given max_shard_size=40 bytes on rank 1 but max_shard_size=100 bytes on rank 0"
    assert all(e.startswith(msg) and e.endswith("Nothing was written.") for e in errors), errors
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def _load_plain(path: str) -> dict[str, Any]:
    _safetensors.counters.reset()
    out = fshard.load(path)
    return {"read": _safetensors.counters.bytes_read, "sha": {n: _sha(t) for n, t in out.items()}}


def test_without_specs_every_rank_gets_every_tensor_read_once_per_job(dist_pool: Any, folder: Path) -> None:
    results = dist_pool.run(_load_plain, str(folder), timeout=TIMEOUT)
    assert all(r["sha"] == {n: _sha(t) for n, t in TENSORS.items()} for r in results)
    assert sum(r["read"] for r in results) == sum(t.nbytes for t in TENSORS.values())
