"""The seed's state-dict scenarios in fshard terms: ``shard_params`` → ``save`` → ``load`` → ``load_state_dict``.

torch's test_state_dict saves ``MyShardedModel1`` (ShardedTensor attributes, a
parameter, a submodule with both) through ``state_dict_hook`` and loads it into a
fresh ``MyShardedModel1()`` through ``pre_load_state_dict_hook``. fshard reads the
sharded attributes in ``shard_params``, writes a checkpoint that any world size
can load, and ``load_state_dict(strict=True)`` sets them back. The local-backend
tests use ``ShardedArray`` attributes; the Gloo tests use torch's ShardedTensors.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import fshard

RANKS = [0, 1, 2, 3]
SHARDED = ("sharded_tensor1", "submodule.sharded_tensor2")
KEYS = ["random_tensor1", "sharded_tensor1", "submodule.random_tensor2", "submodule.sharded_tensor2"]


class Model2(torch.nn.Module):
    """torch's MyShardedModel2, holding a ``ShardedArray`` (or, with ``torch_spec``, a ShardedTensor)."""

    def __init__(self, spec=None, torch_spec=None, seed: int = 2) -> None:
        super().__init__()
        self.sharded_tensor2 = _sharded(spec, torch_spec, seed)
        self.random_tensor2 = torch.nn.Parameter(torch.rand(2, 2, generator=torch.Generator().manual_seed(seed)))


class Model1(torch.nn.Module):
    """torch's MyShardedModel1: a sharded attribute, a parameter and a ``Model2`` submodule."""

    def __init__(self, spec=None, torch_spec=None, seed: int = 1) -> None:
        super().__init__()
        self.sharded_tensor1 = _sharded(spec, torch_spec, seed)
        self.random_tensor1 = torch.nn.Parameter(torch.rand(2, 2, generator=torch.Generator().manual_seed(seed)))
        self.submodule = Model2(spec, torch_spec, seed + 10)


def _sharded(spec, torch_spec, seed: int):
    if torch_spec is not None:
        from torch.distributed._shard import sharded_tensor

        torch.manual_seed(seed)
        return sharded_tensor.rand(torch_spec, 10, 20)
    return None if spec is None else fshard.rand(spec, 10, 20, seed=seed)


def _values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    tree = fshard.shard_params(module)
    return {k: fshard.gather(v) if isinstance(v, fshard.ShardedArray) else v for k, v in tree.items()}


def test_state_dict(tmp_path) -> None:
    m = Model1(fshard.Chunk(0, RANKS))
    tree = fshard.shard_params(m)
    assert sorted(tree) == KEYS
    assert all(isinstance(tree[k], fshard.ShardedArray) for k in SHARDED)
    fshard.save(tmp_path, tree)

    # Another world size: 2 ranks, split by columns.
    module_load = Model1()
    specs = {k: fshard.Chunk(1, [0, 1]) if k in SHARDED else None for k in KEYS}
    loaded = fshard.load(tmp_path, specs=specs)
    result = fshard.load_state_dict(module_load, loaded, strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert module_load.sharded_tensor1.layout == fshard.Chunk(1, [0, 1]).layout((10, 20))  # still sharded
    assert sorted(fshard.shard_params(module_load)) == KEYS
    before, after = _values(m), _values(module_load)
    assert all(torch.equal(before[k], after[k]) for k in KEYS)


def test_state_dict_no_sharded_tensors(tmp_path) -> None:
    m = torch.nn.Linear(10, 10)
    state_dict_before = {k: v.clone() for k, v in m.state_dict().items()}
    fshard.save(tmp_path, fshard.shard_params(m, lambda name, t: fshard.Chunk(0, RANKS)))
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state_dict_before.items())  # the module is untouched
    module_load = torch.nn.Linear(10, 10)
    fshard.load_state_dict(module_load, fshard.load(tmp_path), strict=True)
    assert torch.equal(m.weight, module_load.weight)
    assert torch.equal(m.bias, module_load.bias)


def test_load_state_dict_errors(tmp_path) -> None:
    """fshard has no save-time world size to check (any world size loads); strict loading still checks keys."""
    fshard.save(tmp_path, fshard.shard_params(Model1(fshard.Chunk(0, RANKS))))
    tree = fshard.load(tmp_path)
    with pytest.raises(RuntimeError, match=re.escape('Unexpected key(s) in state_dict: "submodule.sharded_tensor2"')):
        fshard.load_state_dict(_without_submodule_attribute(), tree)
    partial = {k: v for k, v in tree.items() if k != "random_tensor1"}
    with pytest.raises(RuntimeError, match=re.escape('Missing key(s) in state_dict: "random_tensor1"')):
        fshard.load_state_dict(Model1(), partial, strict=True)
    result = fshard.load_state_dict(Model1(), partial, strict=False)
    assert result.missing_keys == ["random_tensor1"]


def _without_submodule_attribute() -> torch.nn.Module:
    m = Model1()
    del m.submodule.sharded_tensor2  # the attribute is gone: the key is unexpected
    return m


def test_a_plain_attribute_is_not_overwritten() -> None:
    m = Model1()
    m.note = "keep"
    tree = {"note": fshard.zeros(fshard.Chunk(0, RANKS), 4)}
    with pytest.raises(RuntimeError, match=re.escape('Unexpected key(s) in state_dict: "note"')):
        fshard.load_state_dict(m, tree, strict=True)
    assert m.note == "keep"


# -- torch's ShardedTensors, on 4 Gloo processes -------------------------------------------------

CPU = [f"rank:{r}/cpu" for r in RANKS]


def _save_model_with_sharded_tensors(path: str) -> dict[str, list[float]]:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    m = Model1(torch_spec=ChunkShardingSpec(dim=0, placements=CPU))
    tree = fshard.shard_params(m)
    assert sorted(tree) == KEYS
    fshard.save(path, tree)
    return {k: v.flatten().tolist() for k, v in _values(m).items()}


def _load_into_modules(path: str) -> tuple[dict[str, list[float]], dict[str, list[float]], bool]:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    specs = {k: fshard.Chunk(1, [3, 1]) if k in SHARDED else None for k in KEYS}
    # Into a module built without specs (its sharded attributes are None): ShardedArrays.
    fresh = Model1()
    fshard.load_state_dict(fresh, fshard.load(path, specs=specs), strict=True)
    # Into a module that holds ShardedTensors: ShardedTensors again, in the loaded layout.
    holding = Model1(torch_spec=ChunkShardingSpec(dim=1, placements=[CPU[2], CPU[0]]), seed=7)
    fshard.load_state_dict(holding, fshard.load(path, specs=specs), strict=True)
    kind = type(holding.sharded_tensor1).__name__ == "ShardedTensor" and dist.get_world_size() == 4
    as_lists = {k: v.flatten().tolist() for k, v in _values(fresh).items()}
    return as_lists, {k: v.flatten().tolist() for k, v in _values(holding).items()}, kind


@pytest.mark.multiprocess
def test_state_dict_of_sharded_tensors_round_trips(dist_pool, tmp_path) -> None:
    saved = dist_pool.run(_save_model_with_sharded_tensors, str(tmp_path))[0]
    for fresh, holding, kind in dist_pool.run(_load_into_modules, str(tmp_path)):
        assert fresh == saved
        assert holding == saved
        assert kind
    # And on another world size: this one process, on the local backend.
    module_load = Model1()
    fshard.load_state_dict(module_load, fshard.load(tmp_path), strict=True)
    assert {k: v.flatten().tolist() for k, v in _values(module_load).items()} == saved
