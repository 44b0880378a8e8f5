"""``apply_module`` on modules with ``torch.nn.utils.parametrize`` parametrizations.

``weight_norm``, ``spectral_norm`` and ``orthogonal`` give a module a class of torch's that refuses
``copy.copy``; its clone still holds the placement's blocks of the originals
(``parametrizations.weight.original0``), from which its ``weight`` property computes the weight.
Data parallel and fully sharded, on the local backend, on 4 Gloo processes and compiled, the
loss, the gradients and spectral_norm's power-iteration buffers are plain torch's on the whole
batch (float64). Where the clone cannot be made soundly, a ``SpecError`` names the tensor.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.utils import parametrizations, parametrize

import fshard

R2, R4 = [0, 1], [0, 1, 2, 3]
KINDS = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
}


def _model(kind: str, linear: type[torch.nn.Linear] = torch.nn.Linear) -> torch.nn.Module:
    torch.manual_seed(0)
    first = KINDS[kind](linear(6, 6, dtype=torch.float64))
    return torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(6, 2, dtype=torch.float64))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return x, y


def _squared_error(module: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(xb), yb, reduction="sum")[None]


def _plain(kind: str) -> dict[str, Any]:
    """Plain torch on the whole batch: the loss, each parameter's gradient, the buffers after the forward."""
    model = _model(kind)
    loss = _squared_error(model, *_data())[0]
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "buffers": dict(model.named_buffers())}


def _sharded(kind: str, ranks: list[int], rules: Callable[[list[int]], Any], step: Any = None) -> dict[str, Any]:
    """fshard's: the loss, each parameter's local shards of its gradient, the buffers after the forward."""
    model = _model(kind)
    before = copy.deepcopy(model.state_dict())
    params, buffers = fshard.shard_module(model, rules(ranks))
    rows, summed = fshard.Chunk(0, ranks), fshard.Partial(fshard.Replicated(ranks))

    def run(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, fshard.ShardedArray]]:
        total, new = fshard.apply_module(
            model,
            params,
            buffers,
            fshard.shard(x, rows),
            fshard.shard(y, rows),
            method=_squared_error,
            out_specs=summed,
        )
        loss = fshard.gather(total)[0]
        loss.backward()
        return loss.detach(), new

    loss, new = (run if step is None else step(run))(*_data())
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the module itself is left as it was
    grads = {n: [(s.meta.offsets, s.meta.sizes, s.data.grad) for s in a.addressable_shards] for n, a in params.items()}
    return {"loss": loss, "grads": grads, "buffers": {n: fshard.gather(a) for n, a in new.items()}}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _check(got: dict[str, Any], want: dict[str, Any]) -> None:
    _close(got["loss"], want["loss"])
    assert sorted(got["grads"]) == sorted(want["grads"])
    for name, shards in got["grads"].items():
        for offsets, sizes, grad in shards:
            _close(grad, want["grads"][name][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
    assert sorted(got["buffers"]) == sorted(want["buffers"])
    for name, value in got["buffers"].items():
        _close(value, want["buffers"][name])


@pytest.mark.parametrize("rules", [fshard.replicated, fshard.fully_sharded], ids=["data_parallel", "fully_sharded"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_parametrized_module_gives_plain_torchs_loss_gradients_and_buffers(kind: str, rules: Any) -> None:
    got = _sharded(kind, R2, rules)
    assert sorted(got["grads"]) == sorted(n for n, _ in _model(kind).named_parameters())
    assert any(".parametrizations.weight.original" in n for n in got["grads"])
    _check(got, _plain(kind))


def test_spectral_norms_power_iteration_updates_its_buffers_as_plain_torch() -> None:
    got, want = _sharded("spectral_norm", R2, fshard.replicated), _plain("spectral_norm")
    assert sorted(got["buffers"]) == ["0.parametrizations.weight.0._u", "0.parametrizations.weight.0._v"]
    model = _model("spectral_norm")
    assert not torch.equal(want["buffers"]["0.parametrizations.weight.0._u"], model[0].parametrizations.weight[0]._u)
    _check(got, want)


def test_a_compiled_step_on_a_weight_normed_module_gives_the_eager_results() -> None:
    torch._dynamo.reset()
    got = _sharded("weight_norm", R2, fshard.fully_sharded, step=lambda run: torch.compile(run, backend="aot_eager"))
    _check(got, _plain("weight_norm"))


def test_inside_parametrize_cached_the_clone_is_refused_naming_the_tensor() -> None:
    model = _model("weight_norm")
    params, buffers = fshard.shard_module(model, fshard.replicated(R2))
    x = fshard.shard(_data()[0], fshard.Chunk(0, R2))
    with parametrize.cached(), pytest.raises(fshard.SpecError) as caught:
        fshard.apply_module(model, params, buffers, x)
    assert str(caught.value).startswith(
        "apply_module() runs the parametrized ['0.weight'] inside torch.nn.utils.parametrize.cached(), whose cache "
        "is keyed by the module"
    )
    assert str(caught.value).endswith("Call apply_module outside cached().")


class _OwnState(torch.nn.Linear):
    """A Linear whose class has its own ``__getstate__``: its copy is not ``torch.nn.Module``'s."""

    def __getstate__(self) -> dict[str, Any]:
        return dict(super().__getstate__())


def test_a_parametrized_module_whose_class_copies_its_own_way_is_refused_naming_the_fix() -> None:
    model = _model("weight_norm", linear=_OwnState)
    params, buffers = fshard.shard_module(model, fshard.replicated(R2))
    x = fshard.shard(_data()[0], fshard.Chunk(0, R2))
    want = (
        "apply_module() cannot clone the parametrized ['0.weight']: its class _OwnState copies otherwise than "
        "torch.nn.Module does, and torch refuses copy.copy of a parametrized module. Remove the parametrizations "
        "before sharding (torch.nn.utils.parametrize.remove_parametrizations(module, name))"
    )
    with pytest.raises(fshard.SpecError, match=re.escape(want)):
        fshard.apply_module(model, params, buffers, x)


# -- 4 Gloo processes ---------------------------------------------------------------------------


def _on_four(kind: str, rules: Any) -> dict[str, Any]:
    return _sharded(kind, R4, rules)


@pytest.mark.multiprocess
@pytest.mark.parametrize("rules", [fshard.replicated, fshard.fully_sharded], ids=["data_parallel", "fully_sharded"])
def test_parametrized_modules_on_four_gloo_processes_give_plain_torchs_results(dist_pool, rules: Any) -> None:
    for kind in sorted(KINDS):
        results = dist_pool.run(_on_four, kind, rules, timeout=120)
        want = _plain(kind)
        for got in results:
            _check(got, want)
