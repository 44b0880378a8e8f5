"""Loads on 4 Gloo processes whose ranks were given different checkpoints or targets raise on every rank.

Each rank reads its own boxes and sends replicated ones on to the others, so ranks that
read two checkpoints (a path per node, one of them stale; the same model saved at two
steps) or ask for different targets would mix their values silently. Every loader (an
fshard checkpoint, a Hugging Face file, a torch DCP folder) compares what the ranks read
before any value is returned; ranks that read copies of one checkpoint load it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import fshard

pytestmark = pytest.mark.multiprocess

ALL = [0, 1, 2, 3]
TIMEOUT = 120
STEPS = {step: {"w": torch.arange(24.0).reshape(6, 4) * step, "b": torch.arange(6.0) - step} for step in (1, 2)}


def _check_mode() -> bool:
    """Whether check mode runs, which names a call with other arguments (another path) before the load does."""
    return bool(fshard.config().check_collectives or os.environ.get("FSHARD_CHECK") == "1")


def _dcp_save(path: Path, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(dict(state), checkpoint_id=str(path), no_dist=True)


def _write(kind: str, path: Path, state: dict[str, torch.Tensor]) -> Path:
    if kind == "fshard":
        fshard.save(path, state)
    elif kind == "hf":
        path.mkdir(parents=True)
        save_file(state, path / "model.safetensors")
    else:
        _dcp_save(path, state)
    return path


def _load(paths: list[str], specs: list[Any]) -> str:
    """This rank loads ``paths[rank]`` into ``specs[rank]``: the error it raised, or the values it got."""
    rank = dist.get_rank()
    try:
        out = fshard.load(paths[rank], specs=specs[rank])
    except (fshard.CheckpointError, fshard.CollectiveMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return repr({k: (v if isinstance(v, torch.Tensor) else fshard.gather(v)).tolist() for k, v in sorted(out.items())})


def _expected(state: dict[str, torch.Tensor], names: list[str]) -> str:
    return repr({k: state[k].tolist() for k in sorted(names)})


KINDS = ["fshard", "hf", "dcp"]
DIFFERENT_CHECKPOINTS = {
    "fshard": "the ranks read different checkpoints (ranks [0, 1, 2]: index.json sha256 ",
    "hf": "the ranks read different checkpoints or targets",
    "dcp": "the ranks read different DCP folders (their .metadata files differ)",
}


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_that_read_two_saves_of_one_model_all_raise(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    first, second = (_write(kind, tmp_path / f"step{s}", STEPS[s]) for s in (1, 2))
    paths = [str(first)] * 3 + [str(second)]  # rank 3 found the newer save
    specs = [{"w": fshard.Chunk(0, ALL), "b": fshard.Replicated(ALL)}] * 4
    results = dist_pool.run(_load, paths, specs, timeout=TIMEOUT)
    if _check_mode():
        assert all(r.startswith("CollectiveMismatchError: Ranks called different collectives") for r in results)
        return
    assert all(r.startswith("CheckpointError: fshard.load of ") for r in results), results
    assert all(DIFFERENT_CHECKPOINTS[kind] in r for r in results), results


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_that_read_copies_of_one_checkpoint_load_it(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    saved = _write(kind, tmp_path / "saved", STEPS[1])
    paths = [str(saved)]
    for r in ALL[1:]:  # a copy per node
        copy = tmp_path / f"copy{r}"
        shutil.copytree(saved, copy)
        paths.append(str(copy))
    specs = [{"w": fshard.Chunk(0, ALL), "b": fshard.Replicated(ALL)}] * 4
    results = dist_pool.run(_load, paths, specs, timeout=TIMEOUT)
    if _check_mode():  # the paths differ: check mode names them
        assert all(r.startswith("CollectiveMismatchError: Ranks called different collectives") for r in results)
        return
    assert results == [_expected(STEPS[1], ["w", "b"])] * 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("targets", ["names", "layouts"])
def test_ranks_that_ask_for_different_targets_all_raise(
    dist_pool: Any, tmp_path: Path, kind: str, targets: str
) -> None:
    saved = _write(kind, tmp_path / "saved", STEPS[1])
    if targets == "names":  # same shapes: without a check, each rank's boxes of "w" and "b" would mix
        specs = [{"w" if r % 2 else "b": fshard.Replicated(ALL)} for r in ALL]
        if kind == "fshard":  # an fshard checkpoint reads every leaf: a spec of None gives a plain tensor
            specs = [{"w": fshard.Replicated(ALL) if r % 2 else None, "b": None} for r in ALL]
    else:
        specs = [{"w": fshard.Chunk(0, ALL if r else ALL[::-1]), "b": fshard.Replicated(ALL)} for r in ALL]
    results = dist_pool.run(_load, [str(saved)] * 4, specs, timeout=TIMEOUT)
    if _check_mode():
        assert all(r.startswith("CollectiveMismatchError: Ranks called different collectives") for r in results)
        return
    assert all(r.startswith("CheckpointError: fshard.load of ") for r in results), results
    want = "read different checkpoints or targets" if kind == "hf" else "asked for different"
    assert all(want in r for r in results), results


@pytest.mark.parametrize("other", ["dcp", "hf"])
def test_ranks_that_find_different_kinds_of_checkpoint_all_raise(dist_pool: Any, tmp_path: Path, other: str) -> None:
    ours = _write("fshard", tmp_path / "fshard", STEPS[1])
    theirs = _write(other, tmp_path / other, STEPS[1])
    results = dist_pool.run(_load, [str(theirs)] + [str(ours)] * 3, [None] * 4, timeout=TIMEOUT)
    if _check_mode():
        assert all(r.startswith("CollectiveMismatchError: Ranks called different collectives") for r in results)
        return
    name = {"dcp": "a torch DCP folder", "hf": "a Hugging Face folder"}[other]
    found = f"the ranks found different kinds of checkpoint there (ranks [0]: {name}; ranks [1, 2, 3]: an fshard"
    assert all(r.startswith("CheckpointError: fshard.load of ") and found in r for r in results), results
    # Nothing was left in flight: the group moves data again.
    assert dist_pool.run(_load, [str(ours)] * 4, [None] * 4, timeout=TIMEOUT) == [_expected(STEPS[1], ["w", "b"])] * 4


def _load_like_on_own_device(path: str) -> str:
    """Every rank asks for the same layouts, each naming the CPU its own way (as ``cuda:{local_rank}`` would)."""
    device = "cpu" if dist.get_rank() % 2 else "cpu:0"
    like = {
        "w": fshard.zeros(fshard.Chunk(0, ALL), 6, 4, device=device),
        "b": fshard.zeros(fshard.Replicated(ALL), 6, device=device),
    }
    try:
        out = fshard.load(path, like=like)
    except (fshard.CheckpointError, fshard.CollectiveMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return repr({k: fshard.gather(v).tolist() for k, v in sorted(out.items())})


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_that_name_their_devices_differently_load_alike(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    saved = _write(kind, tmp_path / "saved", STEPS[1])
    results = dist_pool.run(_load_like_on_own_device, str(saved), timeout=TIMEOUT)
    assert results == [_expected(STEPS[1], ["w", "b"])] * 4
