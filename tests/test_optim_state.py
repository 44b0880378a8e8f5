"""Optimizer state as a tree of arrays (fshard.optimizer_state, fshard.load_optimizer_state).

A run saves parameters and optimizer state on 4 ranks, resumes on 2 or 3 and trains on: its
losses and parameters are those of the run that never stopped (float64). Also: SGD with
momentum, parameter groups, an optimizer that has not stepped, and the refusals.
"""

from __future__ import annotations

import re
from typing import Any

import optree
import pytest
import torch

import fshard

X = torch.randn(32, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
Y = torch.randn(32, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def _params(ranks: list[int]) -> dict[str, fshard.ShardedArray]:
    return fshard.shard_params(_model(), lambda name, t: fshard.Chunk(0, ranks))


def _leaves(params: Any) -> list[torch.Tensor]:
    return [t.requires_grad_() for t in optree.tree_leaves(params)]


def _train(params: dict[str, fshard.ShardedArray], opt: torch.optim.Optimizer, steps: int) -> list[float]:
    model, losses = _model(), []
    for _ in range(steps):
        opt.zero_grad()
        full = fshard.gather(params)
        loss = torch.nn.functional.mse_loss(torch.func.functional_call(model, full, (X,)), Y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_leaves(params), lr=1e-2, weight_decay=0.1)


def _gathered(params: dict[str, fshard.ShardedArray]) -> dict[str, torch.Tensor]:
    return {k: fshard.gather(v) for k, v in params.items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-12)


def _resume(path: str, ranks: list[int], make_opt: Any) -> tuple[dict[str, fshard.ShardedArray], torch.optim.Optimizer]:
    """The user's resume: params from the checkpoint, a new optimizer over them, its state loaded."""
    params = fshard.load(f"{path}/params", like=_params(ranks))
    opt = make_opt(params)
    fshard.load_optimizer_state(opt, params, fshard.load(f"{path}/optim", like=fshard.optimizer_state(opt, params)))
    return params, opt


@pytest.mark.parametrize("world", [2, 3])
def test_adamw_resumed_on_another_world_size_trains_as_the_run_that_never_stopped(tmp_path, world) -> None:
    params = _params([0, 1, 2, 3])
    opt = _adamw(params)
    _train(params, opt, 3)
    fshard.save(tmp_path / "params", params)
    fshard.save(tmp_path / "optim", fshard.optimizer_state(opt, params))
    params2, opt2 = _resume(str(tmp_path), list(range(world)), _adamw)
    assert params2["0.weight"].layout == fshard.Chunk(0, list(range(world))).layout((16, 8))
    assert opt2.state[params2["0.weight"].addressable_data[0]]["exp_avg"].shape == (16 // world + (16 % world > 0), 8)
    resumed = _train(params2, opt2, 2)
    assert resumed == pytest.approx(_train(params, opt, 2), abs=1e-12, rel=0)
    _assert_same(_gathered(params2), _gathered(params))


def test_the_state_tree_holds_arrays_in_the_parameters_layouts_scalars_and_hyperparameters() -> None:
    params = _params([0, 1, 2, 3])
    opt = _adamw(params)
    _train(params, opt, 2)
    state = fshard.optimizer_state(opt, params)
    assert sorted(state["state"]) == ["exp_avg", "exp_avg_sq", "step"]
    for name, a in params.items():
        m = state["state"]["exp_avg"][name]
        assert m.layout == a.layout
        for s, t in zip(m.addressable_data, a.addressable_data):  # the optimizer's own tensors, not copies
            assert s.data_ptr() == opt.state[t]["exp_avg"].data_ptr()
        assert torch.equal(state["state"]["step"][name], torch.tensor(2.0))
    (group,) = state["param_groups"]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (1e-2, 0.1, (0.9, 0.999))
    assert group["arrays"] == ["['0.bias']", "['0.weight']", "['2.bias']", "['2.weight']"]  # optree's key order


def test_sgd_with_momentum_resumes_on_three_ranks(tmp_path) -> None:
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(_leaves(params), lr=0.05, momentum=0.9, dampening=0.1)

    params = _params([0, 1, 2, 3])
    opt = sgd(params)
    _train(params, opt, 2)
    assert sorted(fshard.optimizer_state(opt, params)["state"]) == ["momentum_buffer"]
    fshard.save(tmp_path / "params", params)
    fshard.save(tmp_path / "optim", fshard.optimizer_state(opt, params))
    params2, opt2 = _resume(str(tmp_path), [0, 1, 2], sgd)
    assert _train(params2, opt2, 2) == pytest.approx(_train(params, opt, 2), abs=1e-12, rel=0)


def test_parameter_groups_keep_their_hyperparameters(tmp_path) -> None:
    def grouped(params: Any, lr: float = 1e-2) -> torch.optim.Optimizer:
        weights = [t.requires_grad_() for k in ("0.weight", "2.weight") for t in optree.tree_leaves(params[k])]
        biases = [t.requires_grad_() for k in ("0.bias", "2.bias") for t in optree.tree_leaves(params[k])]
        return torch.optim.AdamW(
            [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": lr}]
        )

    params = _params([0, 1, 2, 3])
    opt = grouped(params, lr=3e-2)
    _train(params, opt, 2)
    saved = fshard.optimizer_state(opt, params)
    assert [g["arrays"] for g in saved["param_groups"]] == [
        ["['0.weight']", "['2.weight']"],
        ["['0.bias']", "['2.bias']"],
    ]
    fshard.save(tmp_path / "params", params)
    fshard.save(tmp_path / "optim", saved)
    params2, opt2 = _resume(str(tmp_path), [0, 1], grouped)  # built with the default lr: the saved one wins
    assert [g["lr"] for g in opt2.param_groups] == [1e-3, 3e-2]  # AdamW's default, and the saved 3e-2
    assert _train(params2, opt2, 2) == pytest.approx(_train(params, opt, 2), abs=1e-12, rel=0)


def test_an_optimizer_that_has_not_stepped_gets_its_state_with_the_parameters_unchanged() -> None:
    params = _params([0, 1, 2, 3])
    before = _gathered(params)
    opt = _adamw(params)
    state = fshard.optimizer_state(opt, params)
    _assert_same(_gathered(params), before)
    assert all(t.grad is None for t in optree.tree_leaves(params))
    assert torch.equal(fshard.gather(state["state"]["exp_avg_sq"]["2.weight"]), torch.zeros(4, 16, dtype=torch.float64))
    assert opt.param_groups[0]["lr"] == 1e-2


def _adamw_frozen(params: Any) -> torch.optim.Optimizer:
    """AdamW over every leaf, the first layer's weight frozen (fine-tuning the rest)."""
    frozen = set(map(id, optree.tree_leaves(params["0.weight"])))
    leaves = [t if id(t) in frozen else t.requires_grad_() for t in optree.tree_leaves(params)]
    return torch.optim.AdamW(leaves, lr=1e-2)


@pytest.mark.parametrize("world", [2, 4])
def test_a_frozen_layer_has_no_state_and_its_run_resumes_as_the_run_that_never_stopped(tmp_path, world) -> None:
    """A parameter that takes no gradient has ``None`` state, before and after steps (torch leaves it out)."""
    params = _params([0, 1, 2, 3])
    opt = _adamw_frozen(params)
    fresh = fshard.optimizer_state(opt, params)  # made by a step of zero lr: the frozen weight gets none
    assert fresh["state"]["exp_avg"]["0.weight"] is None
    assert fresh["state"]["exp_avg"]["0.bias"] is not None
    _train(params, opt, 2)
    state = fshard.optimizer_state(opt, params)
    assert state["state"]["exp_avg"]["0.weight"] is None
    assert state["state"]["step"]["0.weight"] is None
    fshard.save(str(tmp_path / "params"), params)
    fshard.save(str(tmp_path / "optim"), state)
    resumed, again = _resume(str(tmp_path), list(range(world)), _adamw_frozen)
    assert all(t not in again.state for t in optree.tree_leaves(resumed["0.weight"]))
    assert _train(resumed, again, 2) == pytest.approx(_train(params, opt, 2), rel=0, abs=1e-12)
    _assert_same(_gathered(resumed), _gathered(params))


def _train_partly(
    params: dict[str, fshard.ShardedArray], opt: torch.optim.Optimizer, steps: int, first: bool
) -> list[float]:
    """``_train``, where the first layer is used only with ``first`` (else its input is made without it)."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        full = fshard.gather(params)
        h = torch.tanh(X @ full["0.weight"].T + full["0.bias"]) if first else torch.tanh(X.repeat(1, 2))
        loss = torch.nn.functional.mse_loss(h @ full["2.weight"].T + full["2.bias"], Y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_layer_not_used_yet_resumes_without_state_as_the_run_that_never_stopped(tmp_path) -> None:
    """Its state is ``None`` when saved; the fresh optimizer's ``like=`` has one, and it loads as none."""
    params = _params([0, 1, 2, 3])
    opt = _adamw(params)
    _train_partly(params, opt, 2, first=False)
    state = fshard.optimizer_state(opt, params)
    assert state["state"]["exp_avg"]["0.weight"] is None
    assert state["state"]["exp_avg"]["2.weight"] is not None
    fshard.save(str(tmp_path / "params"), params)
    fshard.save(str(tmp_path / "optim"), state)
    resumed, again = _resume(str(tmp_path), [0, 1], _adamw)
    assert all(t not in again.state for t in optree.tree_leaves(resumed["0.weight"]))
    assert _train_partly(resumed, again, 2, first=True) == pytest.approx(
        _train_partly(params, opt, 2, first=True), rel=0, abs=1e-12
    )
    _assert_same(_gathered(resumed), _gathered(params))


def test_a_none_in_params_is_a_parameter_not_there_and_stays_none_in_the_state(tmp_path) -> None:
    params = _params([0, 1, 2, 3])
    tree = {"layers": params, "norm": None}  # a model's tree with a part it lacks
    opt = _adamw(tree)
    _train(params, opt, 2)
    state = fshard.optimizer_state(opt, tree)
    assert all(state["state"][key]["norm"] is None for key in ("exp_avg", "exp_avg_sq", "step"))
    assert state["param_groups"][0]["arrays"] == [f"['layers'][{k!r}]" for k in sorted(params)]
    fshard.save(tmp_path / "optim", state)
    opt.zero_grad(set_to_none=True)  # the resumed run's optimizer, over the same parameters, has not stepped
    opt2 = _adamw(tree)
    fshard.load_optimizer_state(opt2, tree, fshard.load(tmp_path / "optim", like=fshard.optimizer_state(opt2, tree)))
    for a in params.values():
        for t in a.addressable_data:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt2.state[t][key], opt.state[t][key])
    moved = {k: {**v, "norm": v["layers"]["0.bias"]} for k, v in state["state"].items()}  # a value where it has None
    with pytest.raises(fshard.SpecError, match=re.escape("is a tree of another structure than params")) as info:
        fshard.load_optimizer_state(opt2, tree, {**state, "state": moved})
    assert "Expected None" in str(info.value)  # where the trees part: optree's own words
    nested = {k: {**v, "layers": {**v["layers"], "0.bias": [v["layers"]["0.bias"]]}} for k, v in state["state"].items()}
    with pytest.raises(fshard.SpecError, match=re.escape("is a tree of another structure than params")):
        fshard.load_optimizer_state(opt2, tree, {**state, "state": nested})  # a list where an array belongs


def test_a_leaf_the_optimizer_does_not_know_is_named() -> None:
    params = _params([0, 1, 2, 3])
    opt = _adamw({k: v for k, v in params.items() if k != "2.bias"})
    msg = "params['2.bias'] has a shard tensor that the optimizer does not optimize"
    with pytest.raises(fshard.SpecError, match=re.escape(msg)):
        fshard.optimizer_state(opt, params)


def test_optimizer_parameters_outside_the_tree_are_refused() -> None:
    params = _params([0, 1, 2, 3])
    opt = _adamw(params)
    msg = "The optimizer has 16 parameters but params has 8 leaves"
    with pytest.raises(fshard.SpecError, match=re.escape(msg)):
        fshard.optimizer_state(opt, {k: params[k] for k in ("0.weight", "0.bias")})


def test_state_in_other_layouts_or_groups_is_refused() -> None:
    params = _params([0, 1, 2, 3])
    opt = _adamw(params)
    _train(params, opt, 1)
    state = fshard.optimizer_state(opt, params)
    params2 = _params([0, 1])
    opt2 = _adamw(params2)
    with pytest.raises(
        fshard.SpecError, match=re.escape("load the state with like=fshard.optimizer_state(opt, params)")
    ):
        fshard.load_optimizer_state(opt2, params2, state)
    two = torch.optim.AdamW([{"params": _leaves(params2)[:4]}, {"params": _leaves(params2)[4:]}])
    with pytest.raises(fshard.SpecError, match=re.escape("state has 1 parameter groups, the optimizer 2")):
        fshard.load_optimizer_state(two, params2, fshard.optimizer_state(_adamw(params2), params2))


# -- 4 Gloo processes, resumed on 2 -------------------------------------------------------------


def _save_on_four_resume_on_two(path: str) -> dict[str, Any]:
    params = _params([0, 1, 2, 3])
    opt = _adamw(params)
    _train(params, opt, 3)
    fshard.save(f"{path}/params", params)
    fshard.save(f"{path}/optim", fshard.optimizer_state(opt, params))
    params2, opt2 = _resume(path, [0, 1], _adamw)
    resumed = _train(params2, opt2, 2)
    return {
        "resumed": resumed,
        "uninterrupted": _train(params, opt, 2),
        "held": len(params2["0.weight"].addressable_data),
    }


@pytest.mark.multiprocess
def test_state_saved_on_four_gloo_processes_resumes_on_two(dist_pool, tmp_path) -> None:
    results = dist_pool.run(_save_on_four_resume_on_two, str(tmp_path), timeout=120)
    assert [r["held"] for r in results] == [1, 1, 0, 0]  # ranks 2 and 3 hold no shard now
    for r in results:
        assert r["resumed"] == pytest.approx(r["uninterrupted"], abs=1e-12, rel=0)
    assert all(r["resumed"] == results[0]["resumed"] for r in results)


def test_the_state_of_a_parameter_kept_whole_loads_into_its_shards_once_it_is_sharded() -> None:
    # A bias kept as a plain tensor when saved, a Chunk array now: each shard takes its box of the state.
    three = fshard.Chunk(0, [0, 1, 2])
    kept_whole = lambda name, t: fshard.Chunk(0, [0, 1]) if t.ndim == 2 else None  # noqa: E731
    never_stopped = fshard.shard_params(_model(), kept_whole)
    losses = _train_mixed(never_stopped, _adamw(never_stopped), 4)
    whole = fshard.shard_params(_model(), kept_whole)
    opt = _adamw(whole)
    _train_mixed(whole, opt, 2)
    state = fshard.optimizer_state(opt, whole)
    assert isinstance(state["state"]["exp_avg"]["0.bias"], torch.Tensor)
    # The weights keep their layout (leaves of their own); the plain biases become arrays over three ranks.
    params = {
        k: fshard.map_local(lambda t: t.detach().clone(), v)
        if isinstance(v, fshard.ShardedArray)
        else fshard.shard(v.detach(), three)
        for k, v in whole.items()
    }
    opt2 = _adamw(params)
    fshard.load_optimizer_state(opt2, params, state)
    assert [tuple(opt2.state[t]["exp_avg"].shape) for t in params["0.bias"].addressable_data] == [(6,), (6,), (4,)]
    # (opt2 steps the state tensors it was given, opt's own: as torch's load_state_dict shares them too.)
    assert _train_mixed(params, opt2, 2) == pytest.approx(losses[2:], abs=1e-12, rel=0)


def _train_mixed(params: dict[str, Any], opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """``_train`` of a tree of arrays and plain tensors."""
    model, losses = _model(), []
    for _ in range(steps):
        opt.zero_grad()
        full = {k: fshard.gather(v) if isinstance(v, fshard.ShardedArray) else v for k, v in params.items()}
        loss = torch.nn.functional.mse_loss(torch.func.functional_call(model, full, (X,)), Y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_whole_parameters_state_gives_each_replica_held_here_a_tensor_of_its_own() -> None:
    from fshard.backends.local import LocalBackend

    plain = fshard.shard_params(_model(), lambda name, t: None)  # every parameter a plain tensor
    opt = torch.optim.SGD(_leaves(plain), lr=1e-2, momentum=0.9)
    _train_mixed(plain, opt, 2)
    state = fshard.optimizer_state(opt, plain)
    never_stopped = fshard.shard_params(_model(), lambda name, t: None)
    losses = _train_mixed(never_stopped, torch.optim.SGD(_leaves(never_stopped), lr=1e-2, momentum=0.9), 4)
    both = fshard.Replicated([0, 1])
    params = {k: fshard.shard(v.detach(), both, backend=LocalBackend(world_size=2)) for k, v in plain.items()}
    opt2 = torch.optim.SGD(_leaves(params), lr=1e-2, momentum=0.9)
    fshard.load_optimizer_state(opt2, params, state)
    first, second = (opt2.state[t]["momentum_buffer"] for t in params["0.weight"].addressable_data)
    assert first.data_ptr() != second.data_ptr()
    assert _train_mixed(params, opt2, 2) == pytest.approx(losses[2:], abs=1e-12, rel=0)
    assert torch.equal(*params["0.weight"].addressable_data)  # the replicas stepped alike


def test_a_load_that_is_refused_changes_nothing() -> None:
    """The layouts were checked array by array while the state went in: a refusal left earlier arrays half loaded."""
    params = _params([0, 1, 2, 3])
    opt = _adamw(params)
    _train(params, opt, 3)
    state = fshard.optimizer_state(opt, params)
    params2 = dict(_params([0, 1, 2, 3]))
    params2["2.bias"] = fshard.reshard(params2["2.bias"], fshard.Chunk(0, [0, 1]))  # the last array does not fit
    opt2 = _adamw(params2)
    _train(params2, opt2, 1)
    before = {id(t): {k: v.clone() for k, v in s.items()} for t, s in opt2.state.items()}
    with pytest.raises(fshard.SpecError, match=re.escape("state 'exp_avg' of params['2.bias'] has layout")):
        fshard.load_optimizer_state(opt2, params2, state)
    after = {id(t): s for t, s in opt2.state.items()}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
    wrong = {"state": {**state["state"], "exp_avg": {**state["state"]["exp_avg"], "0.bias": torch.zeros(3, 3)}},
             "param_groups": state["param_groups"]}  # fmt: skip
    with pytest.raises(
        fshard.SpecError, match=re.escape("state 'exp_avg' of params['0.bias'] is a tensor of shape (3, 3)")
    ):
        fshard.load_optimizer_state(opt, params, wrong)


@pytest.mark.parametrize("name", ["Adafactor", "LBFGS"])
def test_an_optimizer_whose_state_is_not_per_element_is_refused_naming_it(name: str) -> None:
    params = _params([0, 1])
    opt = getattr(torch.optim, name)(_leaves(params))
    with pytest.raises(fshard.SpecError, match=f"{name}.*no layout can"):
        fshard.optimizer_state(opt, params)


def test_an_optimizer_that_cannot_step_an_empty_shard_is_refused_naming_it() -> None:
    a = fshard.shard(torch.randn(3, 4), fshard.Chunk(0, [0, 1, 2, 3]))  # rank 3's shard is empty
    opt = torch.optim.Adafactor([t.requires_grad_() for t in a.addressable_data])
    with pytest.raises(fshard.SpecError, match=re.escape("shards of shapes [(0, 4)] are empty")):
        fshard.optimizer_state(opt, {"w": a})
    assert not opt.state  # left as it was


def test_an_array_at_two_paths_is_named() -> None:
    params = _params([0, 1])
    tied = {"stage0": params, "stage1": {"head": params["0.weight"]}}
    opt = _adamw(params)
    msg = "params['stage0']['0.weight'] and params['stage1']['head'] are one array (a weight tied across stages)"
    with pytest.raises(fshard.SpecError, match=re.escape(msg)):
        fshard.optimizer_state(opt, tied)


def test_hyperparameters_of_another_number_type_load_as_torch_loads_them(tmp_path) -> None:
    params = _params([0, 1])
    opt = torch.optim.Adam(_leaves(params), lr=1e-2)  # weight_decay=0, an int
    _train(params, opt, 1)
    fshard.save(tmp_path / "ck", fshard.optimizer_state(opt, params))
    params2 = _params([0, 1, 2])
    opt2 = torch.optim.Adam(_leaves(params2), lr=1, weight_decay=1e-5)
    like = fshard.optimizer_state(opt2, params2)
    fshard.load_optimizer_state(opt2, params2, fshard.load(tmp_path / "ck", like=like))
    assert (opt2.param_groups[0]["lr"], opt2.param_groups[0]["weight_decay"]) == (1e-2, 0)
