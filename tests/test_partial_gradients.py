"""Gradients through pending sums, and torch.func inside bodies, on the local backend and 4 Gloo processes.

- A pending sum's summands each meet the other operand of a linear operation (``p * v``):
  the gradient of a replicated ``v`` is the sum over its copies, ``p``'s value times the
  incoming gradient, not one summand's part.
- Gradients of gradients through the reduction of a pending sum: each summand's copy of the
  gradient feeds that summand's own backward, so the second derivative sums over them.
- ``torch.func.grad`` inside a body differentiates a tensor it makes there, which is not a
  tensor closed over from outside the body.
- ``equal`` and ``allclose`` compare a pending sum's value, not its summands.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fshard
from fshard.backends.local import LOCAL

pytestmark = pytest.mark.multiprocess

ALL = [0, 1, 2, 3]
TIMEOUT = 120
D = torch.float64
X = torch.tensor([[1.0, 2.0, -0.5], [3.0, -1.0, 0.25], [0.5, 0.75, 2.0], [-2.0, 1.5, 1.0]], dtype=D)
V = torch.tensor([0.5, -1.5, 2.0], dtype=D)


def _pending_times(backend: Any, op: str) -> list[list[float]]:
    """``d/dv`` of ``(x.sum(0) op v).sum() ** 2`` where ``x.sum(0)`` is pending over the ranks."""
    v = V.clone().requires_grad_()
    p = fshard.shard(X, fshard.Chunk(0, ALL), backend=backend).sum(0)
    w = fshard.shard(v, fshard.Replicated(ALL), backend=backend)
    if op == "mul":
        y = p * w
    elif op == "div":
        y = p / w
    else:
        y = fshard.map_local(lambda a, b: a * b + a, p, w, linear=True)
    (fshard.gather(y).sum() ** 2).backward()
    assert v.grad is not None
    return v.grad.tolist()


def _expected_times(op: str) -> list[float]:
    v = V.clone().requires_grad_()
    p = X.sum(0)
    y = p * v if op == "mul" else p / v if op == "div" else p * v + p
    (y.sum() ** 2).backward()
    assert v.grad is not None
    return v.grad.tolist()


@pytest.mark.parametrize("op", ["mul", "div", "map_local"])
def test_the_gradient_of_a_replicated_operand_of_a_pending_sum_sums_its_copies(dist_pool: Any, op: str) -> None:
    want = _expected_times(op)
    assert _pending_times(LOCAL, op) == pytest.approx(want, rel=1e-12)
    for got in dist_pool.run(_pending_times, None, op, timeout=TIMEOUT):
        assert got == pytest.approx(want, rel=1e-12)


def _second_order(backend: Any, how: str) -> list[list[float]]:
    """``d/dx`` of the squared norm of ``d/dx sin(reduce(pending sum of x))``."""
    x = X.clone().requires_grad_()
    a = fshard.shard(x, fshard.Chunk(0, ALL), backend=backend)
    if how == "sum":
        pending = a.sum(0)
    else:  # a row block's sum of cubes per rank, as a pending sum
        body = fshard.shard_map(lambda b: b.pow(3).sum(0), fshard.Chunk(0, ALL), fshard.Partial(fshard.Replicated(ALL)))
        pending = body(a)
    total = torch.sin(fshard.gather(fshard.reshard(pending, fshard.Replicated(ALL)))).sum()
    (gx,) = torch.autograd.grad(total, (x,), create_graph=True)
    (hx,) = torch.autograd.grad((gx**2).sum(), (x,))
    return hx.tolist()


def _expected_second_order(how: str) -> list[list[float]]:
    x = X.clone().requires_grad_()
    total = torch.sin(x.sum(0) if how == "sum" else x.pow(3).sum(0)).sum()
    (gx,) = torch.autograd.grad(total, (x,), create_graph=True)
    (hx,) = torch.autograd.grad((gx**2).sum(), (x,))
    return hx.tolist()


@pytest.mark.parametrize("how", ["sum", "shard_map"])
def test_gradients_of_gradients_through_a_pending_sum_are_torchs(dist_pool: Any, how: str) -> None:
    want = _expected_second_order(how)
    got = _second_order(LOCAL, how)
    assert torch.allclose(torch.tensor(got, dtype=D), torch.tensor(want, dtype=D), rtol=1e-12, atol=0)
    for got in dist_pool.run(_second_order, None, how, timeout=TIMEOUT):
        assert torch.allclose(torch.tensor(got, dtype=D), torch.tensor(want, dtype=D), rtol=1e-12, atol=0)


def _grad_in_body(backend: Any) -> list[list[float]]:
    x = X.clone().requires_grad_()
    per_row = torch.func.vmap(torch.func.grad(lambda r: torch.sin(r).sum()))
    f = fshard.shard_map(per_row, fshard.Chunk(0, ALL), fshard.Chunk(0, ALL))
    y = fshard.gather(f(fshard.shard(x, fshard.Chunk(0, ALL), backend=backend)))
    (gx,) = torch.autograd.grad(y.sum(), (x,))
    return [y.tolist(), gx.tolist()]


def test_torch_func_grad_inside_a_body_differentiates_its_own_input(dist_pool: Any) -> None:
    want = [torch.cos(X).tolist(), (-torch.sin(X)).tolist()]
    assert _grad_in_body(LOCAL) == want
    assert dist_pool.run(_grad_in_body, None, timeout=TIMEOUT) == [want] * 4


def _compare_pending(backend: Any) -> dict[str, Any]:
    """equal/allclose of a pending sum against its value, and of two pending sums whose values differ."""
    s = fshard.shard(X, fshard.Chunk(0, ALL), backend=backend).sum(0)  # value X.sum(0)
    r = fshard.shard(X.sum(0), fshard.Replicated(ALL), backend=backend)
    big = torch.tensor([[1e6 + 1], [-1e6], [0.0], [0.0]], dtype=D)  # summands of 1 and of 0 that are each close
    p = fshard.shard(big, fshard.Chunk(0, ALL), backend=backend).sum(0)
    q = fshard.shard(big - torch.tensor([[1.0], [0.0], [0.0], [0.0]], dtype=D), fshard.Chunk(0, ALL), backend=backend)
    out: dict[str, Any] = {
        "equal": [fshard.equal(s, r), fshard.equal(r, s), fshard.equal(s, fshard.reshard(r, s.layout))],
        "allclose": [fshard.allclose(s, r), fshard.allclose(r, s), fshard.allclose(p, q.sum(0))],
    }
    one = fshard.shard(V, fshard.Single(0), backend=backend)  # ranks 1-3 hold no shard of it
    try:
        fshard.allclose(one, fshard.map_local(lambda t: t.float(), one))
    except TypeError as exc:
        out["dtypes"] = str(exc)
    out["after"] = fshard.equal(r, r)  # the group is in step: the next collective pairs
    return out


def test_equal_and_allclose_compare_a_pending_sums_value_and_refuse_two_dtypes_on_every_rank(dist_pool: Any) -> None:
    want = {
        "equal": [True, True, True],
        "allclose": [True, True, False],  # values 1 and 0: not close, though each summand is
        "dtypes": "allclose() compares arrays of one dtype, got torch.float64 and torch.float32: convert one first, "
        "e.g. fshard.map_local(lambda t: t.to(torch.float32), a).",
        "after": True,
    }
    assert _compare_pending(LOCAL) == want
    assert dist_pool.run(_compare_pending, None, timeout=TIMEOUT) == [want] * 4


def _terms_times(backend: Any, op: str) -> list[float]:
    """``d/dv`` of ``(gather(p op v) * W).sum()`` where ``p`` is pending over mesh axis "a" and replicated over "b"."""
    mesh = fshard.Mesh((2, 2), ALL, ("a", "b"))
    v = V.clone().requires_grad_()
    p = fshard.reshard(fshard.shard(X[0], fshard.Replicated(ALL), backend=backend),
                       fshard.Partial(fshard.Named(mesh, (None,)), over="a"))  # fmt: skip
    assert p.layout.terms is not None  # each summand held by two replicas
    w = fshard.shard(v, fshard.Replicated(ALL), backend=backend)
    y = p * w if op == "mul" else fshard.map_local(lambda a, b: a * b, p, w, linear=True)
    (fshard.gather(y) * torch.tensor([1.0, 10.0, 100.0], dtype=D)).sum().backward()
    assert v.grad is not None
    return v.grad.tolist()


@pytest.mark.parametrize("op", ["mul", "map_local"])
def test_a_pending_sum_with_replicas_of_its_summands_counts_each_summand_once(dist_pool: Any, op: str) -> None:
    want = (X[0] * torch.tensor([1.0, 10.0, 100.0], dtype=D)).tolist()
    assert _terms_times(LOCAL, op) == pytest.approx(want, rel=1e-12)
    for got in dist_pool.run(_terms_times, None, op, timeout=TIMEOUT):
        assert got == pytest.approx(want, rel=1e-12)
