"""The caller's per-thread torch state in the threads that run shard_map bodies that reduce.

On the local backend the bodies of a call that calls ``psum`` run in a thread per
placement. Autocast, saved-tensor hooks (``save_on_cpu``, checkpoints) and inference
mode, which torch keeps per thread, apply there as they do to bodies that do not reduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp

import fshard

R = [0, 1]
SPECS = (fshard.Chunk(1, R), fshard.Chunk(0, R))

needs_hook_stack = pytest.mark.skipif(
    not hasattr(getattr(torch._C, "_autograd"), "_top_saved_tensors_default_hooks"),  # noqa: B009
    reason="torch < 2.8 cannot read the saved-tensor hooks",
)


def _operands(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 6, generator=g)
    return x.requires_grad_(requires_grad), w.requires_grad_(requires_grad)


def _pair(body):
    """``body`` summed over the placements by psum in the body, and by a Partial result."""
    with_psum = fshard.shard_map(
        lambda a, b: fshard.psum(body(a, b), "x"), SPECS, fshard.Replicated(R), check_vma=False
    )
    no_psum = fshard.shard_map(body, SPECS, fshard.Partial(fshard.Replicated(R)))
    return with_psum, no_psum


def test_autocast_reaches_the_bodies_that_reduce():
    seen: list[torch.dtype] = []

    def body(a, b):
        y = a @ b
        seen.append(y.dtype)
        return y

    x, w = _operands()
    with_psum, no_psum = _pair(body)
    with_psum(x, w)  # the first call finds out that the body reduces
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fshard.gather(with_psum(x, w))
        want = fshard.gather(no_psum(x, w))
        dense = x @ w
    assert seen == [torch.bfloat16] * 4
    assert got.dtype == want.dtype == dense.dtype == torch.bfloat16
    assert torch.equal(got, want)  # two bf16 summands: the same bits in either order
    torch.testing.assert_close(got, dense, atol=0.1, rtol=0.02)


def test_autocast_off_in_the_caller_stays_off_in_the_bodies():
    x, w = _operands()
    with_psum, _ = _pair(lambda a, b: a @ b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with_psum(x, w)
        with torch.autocast("cpu", enabled=False):
            assert fshard.gather(with_psum(x, w)).dtype == torch.float32


def _saved(f, x, w) -> list[tuple[int, ...]]:
    """The shapes of the tensors that saved-tensor hooks see in ``f(x, w)`` and its backward."""
    packed: list[tuple[int, ...]] = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fshard.gather(f(x, w))
    y.sum().backward()
    return packed


@needs_hook_stack
def test_saved_tensors_hooks_see_what_the_bodies_save():
    x, w = _operands(requires_grad=True)
    with_psum, no_psum = _pair(lambda a, b: torch.tanh(a @ b))
    with_psum(x, w)
    want = _saved(no_psum, x, w)
    want_grads = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    got = _saved(with_psum, x, w)
    assert len(want) == 6  # per body: both matmul operands and the tanh
    assert sorted(got) == sorted(want)
    torch.testing.assert_close([x.grad, w.grad], want_grads)


@needs_hook_stack
def test_saved_tensors_hooks_see_the_bodies_in_placement_order():
    packed: list[float] = []

    def body(b):
        e = torch.exp(b)  # saves its result, exp(i) on placement i
        return torch.sin(fshard.psum(e, "x") + b)  # saves its input, sum + i

    ranks = [0, 1, 2, 3]
    f = fshard.shard_map(body, fshard.Chunk(0, ranks), fshard.Chunk(0, ranks), check_vma=False)
    x = torch.arange(4.0, requires_grad=True)
    f(x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (packed.append(float(t[0])), t.detach())[1], lambda t: t):
        for _ in range(3):
            packed.clear()
            f(x)
            total = float(torch.exp(torch.arange(4.0)).sum())
            assert packed == pytest.approx([*torch.exp(torch.arange(4.0)).tolist(), *(total + i for i in range(4))])


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    def __init__(self) -> None:
        super().__init__()
        self.packed = 0
        pack = self.pack_hook

        def counted(t):
            self.packed += 1
            return pack(t)

        self.pack_hook = counted


@needs_hook_stack
def test_save_on_cpu_applies_to_the_bodies():
    x, w = _operands(requires_grad=True)
    with_psum, no_psum = _pair(lambda a, b: torch.tanh(a @ b))
    with_psum(x, w)
    counts, grads = [], []
    for f in (no_psum, with_psum):
        x.grad = w.grad = None
        hooks = _CountingSaveOnCpu()
        with hooks:
            y = fshard.gather(f(x, w))
        y.pow(2).sum().backward()
        counts.append(hooks.packed)
        grads.append([x.grad, w.grad])
    assert counts[0] == counts[1] > 0
    torch.testing.assert_close(grads[1], grads[0])


@needs_hook_stack
def test_a_checkpoint_of_the_whole_call_recomputes_the_bodies():
    runs = []

    def body(a, b):
        runs.append(1)
        h = fshard.psum(torch.tanh(a @ b), "x")
        return fshard.psum(torch.sin(h) * h, "x")

    ranks = [0, 1, 2, 3]
    f = fshard.shard_map(
        body, (fshard.Chunk(1, ranks), fshard.Chunk(0, ranks)), fshard.Replicated(ranks), check_vma=False
    )
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 16, generator=g, requires_grad=True), torch.randn(16, 16, generator=g, requires_grad=True)

    def loss(x, w):
        return fshard.gather(f(x, w)).sum()  # saves nothing outside the bodies

    want = torch.autograd.grad(loss(x, w), (x, w))
    for _ in range(5):
        runs.clear()
        got = torch.autograd.grad(cp.checkpoint(loss, x, w, use_reentrant=False), (x, w))
        torch.testing.assert_close(got, want)
        assert len(runs) == 8  # the forward, then the recomputation of what the bodies saved


@needs_hook_stack
def test_a_checkpoint_around_the_first_call_of_a_body_that_reduces_recomputes_it_alike():
    """No body runs ahead under the checkpoint's hooks to find out that it reduces: its recomputation matches."""

    def body(a):  # a function of its own: no call of it has reduced before this test
        return torch.sin(fshard.psum(torch.tanh(a), "x"))

    def loss(x):
        y = fshard.gather(f(x))
        return (torch.exp(y) * y).sum()  # saves tensors after the call, which the recomputation must match

    ranks = [0, 1, 2, 3]
    f = fshard.shard_map(body, fshard.Replicated(ranks), fshard.Replicated(ranks), check_vma=False)
    x = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(3, 5).requires_grad_()
    got = torch.autograd.grad(cp.checkpoint(loss, x, use_reentrant=False), x)
    y = torch.sin(4 * torch.tanh(x))
    want = torch.autograd.grad((torch.exp(y) * y).sum(), x)
    torch.testing.assert_close(got, want)


def test_inference_mode_reaches_the_bodies_that_reduce():
    seen: list[tuple[bool, bool, bool]] = []

    def body(b):
        y = b * 2
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled(), y.is_inference()))
        return y

    f = fshard.shard_map(lambda b: fshard.psum(body(b), "x"), fshard.Chunk(0, R), fshard.Chunk(0, R), check_vma=False)
    g = fshard.shard_map(body, fshard.Chunk(0, R), fshard.Chunk(0, R))
    x = torch.arange(4.0)
    f(x)
    seen.clear()
    with torch.inference_mode():
        got = fshard.gather(f(x))
        doubled = fshard.gather(g(x))
    assert got.tolist() == [4.0, 8.0, 4.0, 8.0]
    assert doubled.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert seen == [(True, False, True)] * 4
