"""A tensor from outside a per-shard function, used where no view of it can sum its gradient over the ranks.

A tensor that ``map_local``'s or ``shard_map``'s fn closes over (or a gathered one) gets the
sum of every rank's uses as its gradient: each torch call of fn takes a view of it whose
backward sums. Two places take the tensor itself: the inputs of a custom
``torch.autograd.Function`` (its node holds them), and the forward of a reentrant
``torch.utils.checkpoint`` (recomputed in the backward, outside fn). Across processes each
rank got its own uses' gradient there, with no error; in one process autograd summed them.
Both backends now refuse both, alike; a view made in fn, or a non-reentrant checkpoint, sums.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fshard

R = [0, 1, 2, 3]
EXPECTED = [12.0, 16.0]  # the sum over every row of x of d(x * w)/dw


class Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return g * b, (g * a).sum(0)


class ScaledMul(torch.autograd.Function):
    """``Mul`` after a number: the tensors' positions among the inputs are not their edges' (one per tensor)."""

    @staticmethod
    def forward(ctx: Any, s: float, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.s = s
        return a * b * s

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return None, g * b * ctx.s, (g * a).sum(0) * ctx.s


class Scaled(torch.autograd.Function):
    """A Function that closes over ``W`` in its forward, not an input: torch gives ``W`` no gradient through it."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        return a * (W.sum() * 0 + 1)  # W read with nothing recorded: torch gives it no gradient here

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


W = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)


def _grad(case: str) -> Any:
    """``W``'s gradient after a backward through fn of ``case``, or the error's type and message."""
    w = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
    x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2)
    # A reentrant checkpoint records only where an input requires grad (torch warns, and records nothing, else).
    rows = fshard.shard(x.requires_grad_() if case == "reentrant" else x, fshard.Chunk(0, R))
    bodies = {
        "function": lambda t: Mul.apply(t, w),
        "function-of-a-view": lambda t: Mul.apply(t, w.view_as(w)),
        "after-a-number": lambda t: ScaledMul.apply(1.0, t, w),
        "by-keyword": lambda t: ScaledMul.apply(1.0, t, b=w),
        "reentrant": lambda t: checkpoint(lambda u: u * w, t, use_reentrant=True),
        "non-reentrant": lambda t: checkpoint(lambda u: u * w, t, use_reentrant=False),
    }

    def no_grad_use(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = w.abs().max()  # a use that records nothing, and needs no sum
        return t * w * (scale / scale)

    bodies["no-grad-use"] = no_grad_use
    if case == "gathered":
        wf = fshard.gather(fshard.shard(w, fshard.Chunk(0, R[:2])))
        bodies[case] = lambda t: Mul.apply(t, wf)
    if case == "closed-in-forward":
        bodies[case] = lambda t: Scaled.apply(t) * w
        w = W
        w.grad = None
    call = fshard.map_local
    if case == "function-in-shard_map":
        bodies[case] = bodies["function"]
        call = fshard.shard_map(bodies[case], in_specs=fshard.Chunk(0, R), out_specs=fshard.Chunk(0, R))
    try:
        fshard.gather(call(bodies[case], rows) if call is fshard.map_local else call(rows)).sum().backward()
    except fshard.SpecError as exc:
        return type(exc).__name__, str(exc)
    assert w.grad is not None
    return w.grad.tolist()


REFUSED = {
    "function": "passed a tensor of shape (2,) from outside the function's arguments that requires grad to custom "
    "autograd Function Mul",
    "gathered": "to custom autograd Function Mul",
    "after-a-number": "to custom autograd Function ScaledMul",
    "by-keyword": "to custom autograd Function ScaledMul",
    "function-in-shard_map": "to custom autograd Function Mul",
    "reentrant": "inside torch.utils.checkpoint with use_reentrant=True",
}
SUMMED = ["function-of-a-view", "non-reentrant", "no-grad-use"]


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_use_whose_gradient_cannot_sum_is_refused(case: str) -> None:
    kind, msg = _grad(case)
    assert kind == "SpecError"
    assert REFUSED[case] in msg


@pytest.mark.parametrize("case", SUMMED)
def test_a_view_made_in_fn_a_non_reentrant_checkpoint_and_a_no_grad_use_sum_as_before(case: str) -> None:
    assert _grad(case) == EXPECTED


class Outer(torch.autograd.Function):
    """A Function whose forward applies ``Mul`` to ``W``: the inner node records nothing (its forward runs under
    no_grad), and torch gives ``W`` no gradient through it."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        return Mul.apply(a, W) * 0 + a

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def _records_nothing(case: str) -> list[float]:
    w = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
    rows = fshard.shard(torch.arange(8.0, dtype=torch.float64).reshape(4, 2), fshard.Chunk(0, R))

    def under_no_grad(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = Mul.apply(t, w).sum() + 1  # a metric through a custom kernel: nothing recorded
        return t * w * (s / s)

    bodies = {
        "no_grad": under_no_grad,
        "nested": lambda t: Outer.apply(t) * w,
        "compiled": torch.compile(lambda t: t * w, backend="aot_eager"),  # a graph's Function holds w
    }
    fshard.gather(fshard.map_local(bodies[case], rows)).sum().backward()
    assert w.grad is not None
    return w.grad.tolist()


@pytest.mark.parametrize("case", ["no_grad", "nested", "compiled"])
def test_functions_that_record_nothing_and_compiled_graphs_are_not_refused(case: str) -> None:
    assert _records_nothing(case) == EXPECTED


def test_a_tensor_a_functions_forward_closes_over_gets_no_gradient_through_it_as_in_torch() -> None:
    """Not an input of the Function: nothing to refuse (its use outside the Function sums as usual)."""
    assert _grad("closed-in-forward") == EXPECTED


@pytest.mark.multiprocess
def test_on_gloo_the_same_uses_are_refused_on_every_rank_and_the_others_sum(dist_pool: Any) -> None:
    for case, phrase in REFUSED.items():
        for rank, got in enumerate(dist_pool.run(_grad, case, timeout=60)):
            assert got[0] == "SpecError", (case, rank, got)
            assert phrase in got[1], (case, rank, got)
    for case in [*SUMMED, "closed-in-forward"]:
        assert dist_pool.run(_grad, case, timeout=60) == [EXPECTED] * 4, case
    for case in ["no_grad", "nested"]:
        assert dist_pool.run(_records_nothing, case, timeout=60) == [EXPECTED] * 4, case
