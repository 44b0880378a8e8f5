"""``fshard._base.function.apply``: a custom Function's ``apply`` without the per-call signature binding.

The node, values and gradients are those of ``Function.apply``; a ``forward`` with defaults,
a Function with its own ``apply`` and ``torch.func`` transforms go through ``Function.apply``.
"""

from __future__ import annotations

import inspect
from typing import Any
from unittest import mock

import pytest
import torch

from fshard._base.function import apply


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(factor: float, x: torch.Tensor) -> torch.Tensor:
        return x * factor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.factor = inputs[0]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return None, g * ctx.factor

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], factor: float, x: torch.Tensor) -> Any:
        return x * factor, in_dims[1]


class _WithDefault(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, factor: float = 3.0) -> torch.Tensor:
        return x * factor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g * ctx.factor, None


def _no_binding() -> Any:
    """A context in which binding to a signature (what ``Function.apply`` does per call) raises."""
    return mock.patch.object(inspect, "signature", side_effect=AssertionError("bound to a signature"))


def test_the_node_values_and_gradients_are_those_of_function_apply():
    x = torch.arange(3.0, requires_grad=True)
    apply(_Scale, 2.0, x)  # the first call reads forward's signature once
    with _no_binding():
        y = apply(_Scale, 2.0, x)  # the direct call: no binding
    assert type(y.grad_fn) is type(_Scale.apply(2.0, x).grad_fn)  # the same node class
    y.sum().backward()
    assert torch.equal(y, torch.arange(3.0) * 2)
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_a_forward_with_defaults_gets_them_filled_in():
    x = torch.ones(2, requires_grad=True)
    y = apply(_WithDefault, x)  # Function.apply binds factor=3.0; the direct call would not
    y.sum().backward()
    assert torch.equal(y, torch.full((2,), 3.0))
    assert torch.equal(x.grad, torch.full((2,), 3.0))
    with _no_binding(), pytest.raises(AssertionError, match="bound to a signature"):
        apply(_WithDefault, x)  # through Function.apply, which binds


def test_a_function_with_its_own_apply_is_called_through_it():
    calls = []

    class _Own(_Scale):
        @classmethod
        def apply(cls, *args: Any) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
            calls.append(args)
            return super().apply(*args)

    assert torch.equal(apply(_Own, 4.0, torch.ones(1)), torch.full((1,), 4.0))
    assert len(calls) == 1


def test_torch_func_transforms_go_through_function_apply():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(torch.func.vmap(lambda row: apply(_Scale, 5.0, row))(x), x * 5)
    grad = torch.func.grad(lambda t: apply(_Scale, 5.0, t).sum())(torch.ones(3))
    assert torch.equal(grad, torch.full((3,), 5.0))


def test_torch_compile_traces_function_apply_itself_in_one_graph():
    x = torch.arange(3.0)
    step = torch.compile(lambda t: apply(_Scale, 2.0, t) + 1, fullgraph=True, backend="eager")
    assert torch.equal(step(x), x * 2 + 1)
