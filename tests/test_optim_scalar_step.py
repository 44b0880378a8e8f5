"""Optimizer state of a 0-d parameter (CLIP's ``logit_scale``) beside a 2-d one, both bfloat16.

AdamW's ``exp_avg`` and ``exp_avg_sq`` of a 0-d parameter have its shard's shape: arrays in its
layout, in its dtype. Its ``step`` has that shape too but is a count: a scalar, the same on every
shard (checked, and across ranks in check mode), kept in its own dtype (float32) on loading, as
``Optimizer.load_state_dict`` keeps it. In bfloat16 a count stops at 256 (256 + 1 rounds back).
"""

from __future__ import annotations

import re
from typing import Any

import optree
import pytest
import torch

import fshard

BF16 = torch.bfloat16


def _params(ranks: list[int]) -> dict[str, Any]:
    return {
        "logit_scale": fshard.shard(torch.tensor(2.0, dtype=BF16), fshard.Replicated(ranks)),
        "w": fshard.shard(torch.arange(8.0, dtype=BF16).reshape(4, 2) / 8, fshard.Chunk(0, ranks)),
    }


def _adamw(params: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([t.requires_grad_() for t in optree.tree_leaves(params)], lr=1e-3)


def _train(params: dict[str, Any], opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        (fshard.gather(params["logit_scale"]) * fshard.gather(params["w"]).float().sum()).backward()
        opt.step()


def _state_of(params: dict[str, Any], opt: torch.optim.Optimizer, name: str, key: str) -> list[torch.Tensor]:
    return [opt.state[t][key] for t in params[name].addressable_data]


def _resume(path: str, ranks: list[int]) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    params = fshard.load(f"{path}/params", like=_params(ranks))
    opt = _adamw(params)
    fshard.load_optimizer_state(opt, params, fshard.load(f"{path}/optim", like=fshard.optimizer_state(opt, params)))
    return params, opt


def test_the_step_of_a_0d_parameter_is_a_float32_scalar_and_its_moments_are_arrays() -> None:
    params = _params([0, 1])
    opt = _adamw(params)
    _train(params, opt, 3)
    state = fshard.optimizer_state(opt, params)["state"]
    for name in ("logit_scale", "w"):
        step = state["step"][name]
        assert type(step) is torch.Tensor
        assert step.dtype == torch.float32
        assert step.shape == ()
        assert torch.equal(step, torch.tensor(3.0))
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state[key][name]
            assert isinstance(moment, fshard.ShardedArray)
            assert moment.layout == params[name].layout
            assert moment.dtype == BF16


def test_a_0d_parameter_resumed_from_a_bf16_checkpoint_counts_on_and_trains_as_the_run_that_never_stopped(
    tmp_path,
) -> None:
    params = _params([0, 1])
    opt = _adamw(params)
    _train(params, opt, 300)  # past 256, where a bfloat16 count stops
    fshard.save(tmp_path / "params", params)
    fshard.save(tmp_path / "optim", fshard.optimizer_state(opt, params))
    params2, opt2 = _resume(str(tmp_path), [0, 1, 2])  # on three ranks now
    for name in ("logit_scale", "w"):
        for step in _state_of(params2, opt2, name, "step"):
            assert step.dtype == torch.float32
            assert torch.equal(step, torch.tensor(300.0))
        for m in _state_of(params2, opt2, name, "exp_avg"):
            assert m.dtype == BF16
    _train(params2, opt2, 10)
    _train(params, opt, 10)
    for name in ("logit_scale", "w"):
        for step in _state_of(params2, opt2, name, "step"):
            assert torch.equal(step, torch.tensor(310.0))
        assert torch.equal(fshard.gather(params2[name]), fshard.gather(params[name]))  # bit-identical


def test_the_loaded_state_has_the_dtypes_of_torchs_own_load_state_dict(tmp_path) -> None:
    params = _params([0, 1])
    opt = _adamw(params)
    _train(params, opt, 2)
    fshard.save(tmp_path / "params", params)
    fshard.save(tmp_path / "optim", fshard.optimizer_state(opt, params))
    params2, opt2 = _resume(str(tmp_path), [0, 1])
    torchs = _adamw(_params([0, 1]))
    torchs.load_state_dict(opt.state_dict())
    ours = [opt2.state[t] for t in optree.tree_leaves(params2)]
    theirs = [torchs.state[t] for t in torchs.param_groups[0]["params"]]
    assert len(ours) == len(theirs) == 4  # two shards of each parameter
    for mine, want in zip(ours, theirs):
        assert sorted(mine) == sorted(want) == ["exp_avg", "exp_avg_sq", "step"]
        for key in mine:
            assert mine[key].dtype == want[key].dtype
            assert torch.equal(mine[key], want[key])


def test_a_plain_0d_tensor_keeps_a_float32_step_and_bf16_moments() -> None:
    params = {"t": torch.tensor(0.5, dtype=BF16, requires_grad=True)}
    opt = torch.optim.AdamW([params["t"]], lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        (params["t"] * 3).float().backward()
        opt.step()
    state = fshard.optimizer_state(opt, params)["state"]
    assert state["step"]["t"].dtype == torch.float32
    assert state["exp_avg"]["t"].dtype == BF16
    params2 = {"t": torch.tensor(0.5, dtype=BF16, requires_grad=True)}
    opt2 = torch.optim.AdamW([params2["t"]], lr=1e-3)
    fshard.load_optimizer_state(opt2, params2, fshard.optimizer_state(opt, params))
    assert opt2.state[params2["t"]]["step"].dtype == torch.float32
    assert torch.equal(opt2.state[params2["t"]]["step"], torch.tensor(2.0))
    assert opt2.state[params2["t"]]["exp_avg"].dtype == BF16


def test_shards_of_a_0d_parameter_with_different_steps_are_refused() -> None:
    params = _params([0, 1])
    opt = _adamw(params)
    _train(params, opt, 2)
    opt.state[params["logit_scale"].addressable_data[1]]["step"] += 1
    with pytest.raises(fshard.SpecError, match=re.escape("params['logit_scale'] has different 'step' state")):
        fshard.optimizer_state(opt, params)


# -- 4 Gloo processes ---------------------------------------------------------------------------


def _on_four(path: str) -> dict[str, Any]:
    ranks = [0, 1, 2, 3]
    params = _params(ranks)
    opt = _adamw(params)
    _train(params, opt, 3)
    old = fshard.config(check_collectives=True)
    try:
        state = fshard.optimizer_state(opt, params)
        saved = state["state"]["step"]["logit_scale"].clone()  # the state shares the optimizer's tensors
        fshard.save(f"{path}/params", params)
        fshard.save(f"{path}/optim", state)
        params2, opt2 = _resume(path, ranks)
        loaded = {name: [(s.dtype, float(s)) for s in _state_of(params2, opt2, name, "step")] for name in params2}
        _train(params2, opt2, 2)
        _train(params, opt, 2)
        same = all(torch.equal(fshard.gather(params2[n]), fshard.gather(params[n])) for n in params)
        if torch.distributed.get_rank() == 2:  # one rank counts one step more on its shard
            for step in _state_of(params, opt, "logit_scale", "step"):
                step += 1
        try:
            fshard.optimizer_state(opt, params)
            mismatch = None
        except fshard.CollectiveMismatchError as exc:
            mismatch = str(exc)
    finally:
        fshard.config(check_collectives=old.check_collectives)
    return {"saved": saved, "loaded": loaded, "same": same, "mismatch": mismatch}


@pytest.mark.multiprocess
def test_the_step_of_a_0d_parameter_on_four_gloo_processes_is_a_checked_float32_scalar(dist_pool, tmp_path) -> None:
    results = dist_pool.run(_on_four, str(tmp_path), timeout=120)
    for r in results:
        assert type(r["saved"]) is torch.Tensor
        assert torch.equal(r["saved"], torch.tensor(3.0))
        for steps in r["loaded"].values():
            assert steps == [(torch.float32, 3.0)]  # one shard on each rank
        assert r["same"]
        assert r["mismatch"] is not None
        assert r["mismatch"].startswith("'step' of ['logit_scale'] (in optimizer_state(")
        assert re.search(
            r"\) differs between ranks: ranks \[0, 1, 3\] passed digest \w+, ranks \[2\] passed", r["mismatch"]
        )
