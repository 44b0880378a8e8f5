"""``torch.compile`` of a fully-sharded step with ``regather=True`` on 4 Gloo processes.

The backward unpacks the tokens that stand in for the gathered parameters (saved-tensor hooks)
and gathers the parameters again while TorchDynamo's frame hook is still on: those hooks run
eagerly, so the gather is a collective and not a traced frame. The compiled step must give the
eager step's loss and gradients (float64), which match the local backend's and plain torch's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fshard
from fshard._exec import regather as _regather
from fshard.backends.local import LocalBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return x, y


def _squared_error(module: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(xb), yb, reduction="sum")[None]


def _regather_step(compiler: str | None, backend: Any = None) -> dict[str, Any]:
    """The loss, each parameter's local shards of its gradient, and the copies the backward gathered again."""
    model = _model()
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(R), backend=backend)
    rows, summed = fshard.Chunk(0, R), fshard.Partial(fshard.Replicated(R))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total, _ = fshard.apply_module(
            model,
            params,
            buffers,
            fshard.shard(x, rows, backend=backend),
            fshard.shard(y, rows, backend=backend),
            method=_squared_error,
            out_specs=summed,
            regather=True,
        )
        loss = fshard.gather(total)[0]
        loss.backward()
        return loss.detach()

    if compiler is not None:
        step = torch.compile(step, backend=compiler)
    before = _regather.regathers()
    loss = step(*_data())
    grads = {
        name: [(s.meta.offsets, s.meta.sizes, s.data.grad) for s in a.addressable_shards] for name, a in params.items()
    }
    return {"loss": loss, "grads": grads, "regathers": _regather.regathers() - before}


def _compiled_and_eager() -> dict[str, Any]:
    fshard.clear_caches()
    torch._dynamo.reset()
    compiled = _regather_step("aot_eager")
    torch._dynamo.reset()
    fshard.clear_caches()
    return {"compiled": compiled, "eager": _regather_step(None)}


def _dense() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model()
    x, y = _data()
    loss = _squared_error(model, x, y)[0]
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _check(run: dict[str, Any], want_loss: torch.Tensor, want_grads: dict[str, torch.Tensor]) -> None:
    _close(run["loss"], want_loss)
    assert sorted(run["grads"]) == sorted(want_grads)
    for name, shards in run["grads"].items():
        for offsets, sizes, grad in shards:
            assert grad is not None
            _close(grad, want_grads[name][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])


def test_a_compiled_regather_step_on_gloo_gives_the_eager_loss_and_gradients(dist_pool) -> None:
    results = dist_pool.run(_compiled_and_eager, timeout=300)
    want_loss, want_grads = _dense()
    for got in results:
        assert (got["compiled"]["regathers"], got["eager"]["regathers"]) == (1, 1)  # one movement, gathered again
        _check(got["compiled"], want_loss, want_grads)
        _check(got["eager"], want_loss, want_grads)
        torch.testing.assert_close(got["compiled"]["loss"], got["eager"]["loss"], rtol=0, atol=1e-12)


def test_a_compiled_regather_step_on_the_local_backend_gives_plain_torchs_loss_and_gradients() -> None:
    torch._dynamo.reset()
    fshard.clear_caches()
    got = _regather_step("aot_eager", LocalBackend(world_size=len(R)))
    want_loss, want_grads = _dense()
    assert got["regathers"] == 1  # the parameters, one movement, gathered again
    _check(got, want_loss, want_grads)
