"""shard_module and apply_module against dense models (float64): tied weights, buffers, checkpointing, DP, FSDP.

Each program trains with SGD through the module API and is compared with the same steps
on the unsharded model, on the local backend (4 ranks in this process) and on 4 Gloo
processes.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from test_examples import example

import fshard

RANKS = [0, 1, 2, 3]
VOCAB, SEQ, D, BATCH = 16, 6, 8, 8
ATOL = 1e-12


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.qkv, self.proj = torch.nn.LayerNorm(D), torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.fc, self.out = torch.nn.Linear(D, 2 * D), torch.nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(x)))


class GPT(torch.nn.Module):
    """4 blocks; the head tied to the token embedding when ``tie``; blocks checkpointed when ``reentrant`` is a bool."""

    def __init__(self, tie: bool = True, reentrant: bool | None = None) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, D), torch.nn.Embedding(SEQ, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.ln, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, VOCAB, bias=False)
        if tie:
            self.head.weight = self.wte.weight
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln(x))


def gpt(**kwargs: bool | None) -> GPT:
    torch.manual_seed(0)
    return GPT(**kwargs).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_sum(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum")[None]


def sgd(params: dict[str, fshard.ShardedArray], lr: float = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD([t for a in params.values() for t in a.addressable_data], lr=lr)


def fshard_steps(model, params, buffers, steps, ranks, rows=None, first_step=0):
    """``steps`` SGD steps through apply_module; the losses. ``rows(t)``: the per-rank batch array of ``t``."""
    rows = rows or (lambda t: fshard.shard(t, fshard.Chunk(0, ranks)))
    opt, losses = sgd(params), []
    for step in range(first_step, first_step + steps):
        tokens, targets = batch(step)
        loss, buffers = fshard.apply_module(
            model, params, buffers, rows(tokens), rows(targets),
            method=loss_sum, out_specs=fshard.Partial(fshard.Replicated(ranks)),
        )  # fmt: skip
        loss = fshard.gather(loss)[0] / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, buffers


def dense_steps(model, steps, first_step=0):
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
    for step in range(first_step, first_step + steps):
        tokens, targets = batch(step)
        loss = loss_sum(model, tokens, targets)[0] / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def assert_params_equal(params, model) -> None:
    want = dict(model.named_parameters())
    assert list(params) == list(want)  # named_parameters() lists a tied parameter once
    for name, a in params.items():
        torch.testing.assert_close(fshard.gather(a), want[name].detach(), rtol=0, atol=ATOL)


# -- tied weights ---------------------------------------------------------------------------


def test_a_tied_parameter_is_one_array_whose_gradient_is_the_sum_of_its_uses() -> None:
    model = gpt()
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(RANKS))
    assert "wte.weight" in params
    assert "head.weight" not in params
    assert buffers == {}
    tokens, targets = batch(0)
    rows = fshard.Chunk(0, RANKS)
    loss, _ = fshard.apply_module(
        model, params, buffers, fshard.shard(tokens, rows), fshard.shard(targets, rows),
        method=loss_sum, out_specs=fshard.Partial(fshard.Replicated(RANKS)),
    )  # fmt: skip
    fshard.gather(loss).sum().backward()
    loss_sum(model, tokens, targets).sum().backward()
    for s in params["wte.weight"].addressable_shards:
        box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
        torch.testing.assert_close(s.data.grad, model.wte.weight.grad[box], rtol=0, atol=ATOL)
    assert model.wte.weight.grad.abs().sum() > 0


def test_a_rule_that_lays_out_a_tied_name_otherwise_is_refused_not_ignored() -> None:
    """The array is laid out by its first name's rule: a rule for the head's name alone would do nothing."""
    model = gpt()
    rules = {"head.weight": fshard.Chunk(0, RANKS), "*": fshard.Replicated(RANKS)}
    with pytest.raises(fshard.SpecError, match=r"tied to 'wte.weight' \(the same tensor\)"):
        fshard.shard_module(model, rules)
    same = {"head.weight": fshard.Chunk(0, RANKS), "wte.weight": fshard.Chunk(0, RANKS), "*": fshard.Replicated(RANKS)}
    params, _ = fshard.shard_module(model, same)  # both names alike: one array, as asked
    assert params["wte.weight"].layout == fshard.Chunk(0, RANKS).layout(tuple(model.wte.weight.shape))


class _ParamAlsoBuffer(torch.nn.Module):
    def __init__(self, buffer_first: bool) -> None:
        super().__init__()
        w = torch.nn.Parameter(torch.randn(4, 4))
        self.a = torch.nn.Module()
        self.lin = torch.nn.Linear(4, 4, bias=False)
        if buffer_first:  # named_modules() meets self.a first
            self.a.register_buffer("w", w)
            self.lin.weight = w
        else:
            self.lin.weight = w
            self.a.register_buffer("w", w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + x @ self.a.w


@pytest.mark.parametrize("buffer_first", [False, True], ids=["parameter-first", "buffer-first"])
def test_a_tensor_that_is_a_parameter_and_a_buffer_is_refused_naming_both(buffer_first: bool) -> None:
    model = _ParamAlsoBuffer(buffer_first)
    both = r"one tensor as parameter 'lin\.weight' and as buffer 'a\.w'"
    with pytest.raises(fshard.SpecError, match=both):  # not a trainable parameter kept as a buffer
        fshard.shard_module(model, fshard.fully_sharded(RANKS))


@pytest.mark.parametrize("rules", ["replicated", "fully_sharded"])
def test_a_tied_gpt_trains_like_the_dense_model(rules: str) -> None:
    model, dense = gpt(), gpt()
    params, buffers = fshard.shard_module(model, getattr(fshard, rules)(RANKS))
    losses, _ = fshard_steps(model, params, buffers, 3, RANKS)
    assert losses == pytest.approx(dense_steps(dense, 3), rel=0, abs=ATOL)
    assert_params_equal(params, dense)
    assert dense.head.weight is dense.wte.weight  # the dense model trained one tensor too


def test_trained_tied_parameters_load_back_into_a_module() -> None:
    model, dense = gpt(), gpt()
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(RANKS))
    fshard_steps(model, params, buffers, 2, RANKS)
    dense_steps(dense, 2)
    fresh = gpt()
    fshard.load_state_dict(fresh, {**params, **buffers})
    assert fresh.head.weight is fresh.wte.weight
    torch.testing.assert_close(fresh.wte.weight, dense.wte.weight, rtol=0, atol=ATOL)


def test_a_weight_tied_across_stages_sharded_apart_is_warned_of() -> None:
    emb, head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight  # a head tied to the embedding, in two stages
    fshard.shard_module(emb, fshard.fully_sharded(RANKS))
    tied = r"parameter 'weight' of this Linear was made an array before as 'weight' of a Embedding .* tie is lost"
    with pytest.warns(UserWarning, match=tied) as seen:
        fshard.shard_module(head, fshard.fully_sharded(RANKS))
    assert seen[0].filename == __file__  # at the caller's line
    fshard.shard_module(head, fshard.fully_sharded(RANKS))  # the same module again: nothing to warn of


class _Rope(torch.nn.Module):
    """A buffer outside the state dict (as Hugging Face Llama's rotary ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.inv_freq


def test_a_buffer_outside_the_state_dict_loads_back_as_shard_module_returns_it() -> None:
    params, buffers = fshard.shard_module(_Rope(), fshard.fully_sharded(RANKS))
    assert "inv_freq" in buffers
    changed = {**params, "inv_freq": buffers["inv_freq"] * 2}
    fresh = _Rope()
    fshard.load_state_dict(fresh, changed)
    assert fresh.inv_freq.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert torch.equal(fresh.lin.weight, fshard.gather(params["lin.weight"]))
    with pytest.raises(fshard.CheckpointError, match=r"buffer 'inv_freq' \(persistent=False\) a shape \(3,\)"):
        fshard.load_state_dict(_Rope(), {**params, "inv_freq": torch.zeros(3)})


def test_the_module_is_not_changed() -> None:
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(RANKS))
    fshard_steps(model, params, buffers, 1, RANKS)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


# -- activation checkpointing ---------------------------------------------------------------


@pytest.mark.parametrize("rules", ["replicated", "fully_sharded"])
def test_a_checkpointed_gpt_trains_like_the_dense_model_for_5_steps(rules: str) -> None:
    model, dense = gpt(reentrant=False), gpt(reentrant=False)
    params, buffers = fshard.shard_module(model, getattr(fshard, rules)(RANKS))
    losses, _ = fshard_steps(model, params, buffers, 5, RANKS)
    assert losses == pytest.approx(dense_steps(dense, 5), rel=0, abs=ATOL)
    assert_params_equal(params, dense)


def test_reentrant_checkpointing_is_refused() -> None:
    model = gpt(reentrant=True)
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    with pytest.raises(fshard.SpecError, match=re.escape("Pass use_reentrant=False to checkpoint()")) as info:
        fshard_steps(model, params, buffers, 1, RANKS)
    name = re.search(r"parameter '([\w.]+)' was read inside", str(info.value))
    assert name is not None
    assert name[1] in params  # its name in the module applied, not its submodule's


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpoint_around_the_whole_call_works_either_way(reentrant: bool) -> None:
    """Only a reentrant checkpoint inside the forward is refused: around apply_module both give the dense gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(RANKS))
    blocks = [t.requires_grad_() for a in params.values() for t in a.addressable_data]
    x = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(4, 6).requires_grad_()

    def region(t: torch.Tensor) -> torch.Tensor:
        out, _ = fshard.apply_module(model, params, buffers, fshard.shard(t, fshard.Chunk(0, RANKS)))
        return fshard.gather(out)

    torch.utils.checkpoint.checkpoint(region, x, use_reentrant=reentrant).square().sum().backward()
    xd = x.detach().clone().requires_grad_()
    model(xd).square().sum().backward()
    torch.testing.assert_close(x.grad, xd.grad, rtol=0, atol=ATOL)
    assert all(t.grad is not None for t in blocks)
    for name, p in model.named_parameters():
        for s in params[name].addressable_shards:
            box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
            torch.testing.assert_close(s.data.grad, p.grad[box], rtol=0, atol=ATOL)


# -- buffers --------------------------------------------------------------------------------


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(), torch.nn.Linear(6, 1)
    ).double()


def bn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)


def bn_dense_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int
) -> float:
    """Data parallelism by hand: each of ``n`` row blocks normalised by its own statistics, running stats averaged."""
    start, ends, loss = dict(model.named_buffers()), [], 0
    for xb, yb in zip(x.chunk(n), y.chunk(n)):
        mine = {k: b.clone() for k, b in start.items()}  # each block's forward updates its own copy
        loss = loss + F.mse_loss(torch.func.functional_call(model, mine, (xb,)), yb, reduction="sum")
        ends.append(mine)
    with torch.no_grad():
        for k, b in start.items():
            b.copy_(sum(e[k] for e in ends) // n if not b.is_floating_point() else sum(e[k] for e in ends) / n)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def bn_fshard_step(model, params, buffers, opt, x, y, ranks):
    rows = fshard.Chunk(0, ranks)

    def loss(m, xb, yb):
        return F.mse_loss(m(xb), yb, reduction="sum")[None]

    out, buffers = fshard.apply_module(
        model, params, buffers, fshard.shard(x, rows), fshard.shard(y, rows),
        method=loss, out_specs=fshard.Partial(fshard.Replicated(ranks)),
    )  # fmt: skip
    total = fshard.gather(out)[0]
    opt.zero_grad()
    total.backward()
    opt.step()
    return float(total.detach()), buffers


def bn_trained(
    rules: Any,
) -> tuple[torch.nn.Module, dict[str, fshard.ShardedArray], dict[str, fshard.ShardedArray], torch.nn.Module]:
    """``bn_model`` sharded by ``rules`` and trained 3 steps beside the dense model, the losses compared at each."""
    model, dense = bn_model(), bn_model()
    params, buffers = fshard.shard_module(model, rules)
    assert sorted(buffers) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert not any(t.requires_grad for a in buffers.values() for t in a.addressable_data)
    opt, dense_opt = sgd(params), torch.optim.SGD(dense.parameters(), lr=0.1)
    for step in range(3):
        x, y = bn_batch(step)
        got, buffers = bn_fshard_step(model, params, buffers, opt, x, y, RANKS)
        assert got == pytest.approx(bn_dense_step(dense, dense_opt, x, y, len(RANKS)), rel=0, abs=ATOL)
    assert_params_equal(params, dense)
    return model, params, buffers, dense


def test_batchnorm_trains_data_parallel_with_running_stats_averaged_over_the_ranks() -> None:
    model, _, buffers, dense = bn_trained(fshard.replicated(RANKS))
    for name, b in dense.named_buffers():
        shards = [s.data for s in buffers[name].addressable_shards]
        assert len(shards) == len(RANKS)
        assert all(torch.equal(s, shards[0]) for s in shards)  # every replica bit-identical
        torch.testing.assert_close(shards[0], b, rtol=0, atol=ATOL)
    assert int(fshard.gather(buffers["1.num_batches_tracked"])) == 3
    assert int(model[1].num_batches_tracked) == 0  # the module's own buffers are untouched


def test_batchnorm_trains_fully_sharded_like_data_parallel() -> None:
    """The buffers move beside the parameters in one tree, and their copies need no gradient (BatchNorm refuses one)."""
    _, _, buffers, dense = bn_trained(fshard.fully_sharded(RANKS))
    for name, b in dense.named_buffers():
        torch.testing.assert_close(fshard.gather(buffers[name]), b, rtol=0, atol=ATOL)


def test_batchnorm_accumulates_fully_sharded_under_no_sync() -> None:
    """Its buffers are new arrays at every micro-batch: what no_sync keeps aside is keyed on the parameters alone.

    The gradients are those of the same micro-batches each summed at once (two backwards that both sync).
    """
    x, y = bn_batch(0)
    rows, summed = fshard.Chunk(0, RANKS), fshard.Partial(fshard.Replicated(RANKS))

    def loss(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(xb), yb, reduction="sum")[None]

    grads = []
    for keep_aside in (True, False):
        model = bn_model()
        params, buffers = fshard.shard_module(model, fshard.fully_sharded(RANKS))
        for k, (xb, yb) in enumerate([(x[::2], y[::2]), (x[1::2], y[1::2])]):
            with fshard.no_sync() if keep_aside and k == 0 else contextlib.nullcontext():
                xs, ys = fshard.shard(xb, rows), fshard.shard(yb, rows)
                out, buffers = fshard.apply_module(model, params, buffers, xs, ys, method=loss, out_specs=summed)
                fshard.gather(out)[0].backward()
        sgd(params).step()  # refused where a micro-batch's gradients were still kept aside
        grads.append([t.grad for a in params.values() for t in a.addressable_data])
    assert all(g is not None for g in grads[0])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_buffers_of_a_module_in_eval_mode_come_back_unchanged() -> None:
    model = bn_model().eval()
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    x, _ = bn_batch(0)
    out, new = fshard.apply_module(model, params, buffers, fshard.shard(x, fshard.Chunk(0, RANKS)))
    assert all(new[k] is buffers[k] for k in buffers)
    torch.testing.assert_close(fshard.gather(out), model(x), rtol=0, atol=ATOL)


class Kept(torch.nn.Module):
    """Buffers a forward keeps: running extremes from infinities, values written alike or per batch, counters, flags."""

    def __init__(self) -> None:
        super().__init__()
        inf = float("inf")
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("low", torch.full((4,), inf))  # the last element stays +inf on every placement
        self.register_buffer("high", torch.full((3,), -inf))
        self.register_buffer("alike", torch.tensor([1e8, 3e9, 1e30]))  # far from what the forward writes
        self.register_buffer("own", torch.full((3,), 1e30))
        self.register_buffer("steps", torch.tensor(0))
        self.register_buffer("ticks", torch.tensor(0))
        self.register_buffer("ready", torch.tensor(False))
        self.register_buffer("negative", torch.zeros(3, dtype=torch.bool))

    def forward(self, xb: torch.Tensor) -> torch.Tensor:
        self.low[:3] = torch.minimum(self.low[:3], xb.amin(0))  # in place
        self.high = torch.maximum(self.high, xb.amax(0))  # assigned
        self.alike.copy_(torch.tensor([1.5, 0.25, 7.0]))
        self.own.copy_(xb.sum(0))
        self.steps += 1
        self.ticks.add_((xb[:, 0] > 0).sum())
        self.ready = torch.tensor(True)
        self.negative = (xb < 0).any(0)
        return self.lin(xb)


def kept_buffers(ranks: list[int]) -> dict[str, fshard.ShardedArray]:
    """``Kept``'s buffers after one forward on 12 rows, each placement of ``ranks`` running on its own."""
    torch.manual_seed(0)
    model, x = Kept(), torch.randn(12, 3)
    params, buffers = fshard.shard_module(model, fshard.replicated(ranks))
    return fshard.apply_module(model, params, buffers, fshard.shard(x, fshard.Chunk(0, ranks)))[1]


@pytest.mark.parametrize("ranks", [[0], [0, 1, 2], RANKS])
def test_updated_buffers_are_the_value_the_placements_share_or_else_the_mean_of_their_values(ranks) -> None:
    """Exact where every placement holds one value, infinities included; else the mean of the values, not of steps."""
    new = {k: fshard.gather(a) for k, a in kept_buffers(ranks).items()}
    torch.manual_seed(0)
    Kept()
    blocks, n = torch.randn(12, 3).chunk(len(ranks)), len(ranks)

    def assert_mean(got: torch.Tensor, values: list[torch.Tensor]) -> None:  # summed in an order of fshard's
        torch.testing.assert_close(got, sum(values) / n, rtol=1e-6, atol=0)

    assert_mean(new["low"][:3], [b.amin(0) for b in blocks])
    assert new["low"][3] == float("inf")
    assert_mean(new["high"], [b.amax(0) for b in blocks])
    assert torch.equal(new["alike"], torch.tensor([1.5, 0.25, 7.0]))
    assert_mean(new["own"], [b.sum(0) for b in blocks])
    assert int(new["steps"]) == 1
    assert int(new["ticks"]) == sum(int((b[:, 0] > 0).sum()) for b in blocks) // n  # rounded down
    assert new["ready"].dtype == torch.bool
    assert bool(new["ready"])
    assert torch.equal(new["negative"], torch.stack([(b < 0).any(0) for b in blocks]).all(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_value_every_placement_writes_comes_back_exactly_on_3_placements(dtype: torch.dtype) -> None:
    """Three copies of 0.1 sum to a number whose third is not 0.1, and a step from 3e9 to 0.1 loses its digits."""

    class Tenth(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("value", torch.tensor([0.0, 3e9], dtype=dtype))

        def forward(self, xb: torch.Tensor) -> torch.Tensor:
            self.value.fill_(0.1)
            return xb

    ranks = [0, 1, 2]
    model = Tenth()
    _, buffers = fshard.shard_module(model, fshard.replicated(ranks))
    _, new = fshard.apply_module(model, {}, buffers, fshard.shard(torch.zeros(6, 2), fshard.Chunk(0, ranks)))
    assert torch.equal(fshard.gather(new["value"]), torch.full((2,), 0.1, dtype=dtype))


@pytest.mark.parametrize(("dtype", "big"), [(torch.float16, 20000.0), (torch.bfloat16, 2e38), (torch.float32, 2e38)])
def test_the_mean_of_values_near_the_largest_of_their_dtype_is_finite(dtype: torch.dtype, big: float) -> None:
    """Four values whose sum exceeds the dtype's largest number: their mean is still theirs, not inf."""

    class Near(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("value", torch.zeros(1, dtype=dtype))

        def forward(self, xb: torch.Tensor) -> torch.Tensor:
            self.value.fill_(big * float(xb[0, 0]))  # 1.0 on two placements, 1.5 on the others
            return xb

    x = torch.tensor([1.0, 1.0, 1.5, 1.5]).repeat_interleave(2).reshape(8, 1)
    model = Near()
    _, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    _, new = fshard.apply_module(model, {}, buffers, fshard.shard(x, fshard.Chunk(0, RANKS)))
    values = torch.tensor([big, big, 1.5 * big, 1.5 * big], dtype=dtype).double()
    assert torch.equal(fshard.gather(new["value"]), values.mean().reshape(1).to(dtype))


def _gloo_kept() -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    return {k: a.local_tensor() for k, a in kept_buffers(list(range(dist.get_world_size()))).items()}


@pytest.mark.multiprocess
def test_updated_buffers_on_4_gloo_processes_are_the_local_backends_bit_for_bit(dist_pool) -> None:
    want = {k: fshard.gather(a) for k, a in kept_buffers(RANKS).items()}
    for got in dist_pool.run(_gloo_kept, timeout=120):
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert got[name].dtype == t.dtype, name
            assert torch.equal(got[name], t), name


class Assigning(torch.nn.Module):
    """Assigns a new tensor to its buffer ``name`` in the forward."""

    def __init__(self, name: str, value: torch.Tensor, persistent: bool = True) -> None:
        super().__init__()
        self.name = name
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer(name, value, persistent=persistent)

    def forward(self, xb: torch.Tensor) -> torch.Tensor:
        setattr(self, self.name, getattr(self, self.name) + 1)
        return self.lin(xb)


def apply_assigning(model: torch.nn.Module) -> dict[str, fshard.ShardedArray]:
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    return fshard.apply_module(model, params, buffers, fshard.shard(torch.randn(8, 4), fshard.Chunk(0, RANKS)))[1]


class _Counter(torch.nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            self.count.add_(1)
        else:
            self.count = self.count + 1
        return x


class _TiedCounters(torch.nn.Module):
    """One buffer in two submodules; the forward updates it through the second one."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        count = torch.zeros(())
        self.a, self.b = _Counter(in_place), _Counter(in_place)
        self.a.register_buffer("count", count)
        self.b.register_buffer("count", count)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.b(x))


def test_a_tied_buffer_replaced_under_its_second_name_is_refused_and_updated_in_place_comes_back() -> None:
    lost = r"replaced buffer 'b\.count', the same tensor as buffer 'a\.count': only 'a\.count' comes back"
    with pytest.raises(fshard.SpecError, match=lost):
        apply_assigning(_TiedCounters(in_place=False))
    assert fshard.gather(apply_assigning(_TiedCounters(in_place=True))["a.count"]).item() == 1.0


class Writing(Assigning):
    """Writes into its buffer ``name`` in place in the forward."""

    def forward(self, xb: torch.Tensor) -> torch.Tensor:
        getattr(self, self.name).add_(1)
        return self.lin(xb)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (Writing("ema", torch.zeros(4), persistent=False), "a non-persistent buffer: only the persistent"),
        (Writing("ema", torch.zeros(4)).eval(), "a buffer of a submodule in eval mode (Writing)"),
    ],
    ids=["non-persistent", "eval-mode"],
)
def test_writing_into_a_read_only_buffer_in_place_is_refused_naming_it_and_its_fix(model, message: str) -> None:
    before = model.ema.clone()
    refused = r"^apply_module\(\): the forward wrote in place into buffer 'ema', "
    with pytest.raises(fshard.SpecError, match=refused) as info:
        apply_assigning(model)
    assert message in str(info.value)
    assert torch.equal(model.ema, before)  # the module's own buffer, and the array's, are as they were


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (Assigning("calls", torch.zeros(()), persistent=False), "non-persistent buffer: only the persistent"),
        (Assigning("calls", torch.zeros(())).eval(), "a buffer of a submodule in eval mode (Assigning)"),
        (Assigning("calls", torch.zeros((), dtype=torch.complex64)), "a torch.complex64 buffer"),
    ],
    ids=["non-persistent", "eval-mode", "complex"],
)
def test_assigning_to_a_read_only_buffer_raises_naming_it_rather_than_losing_the_value(model, message: str) -> None:
    with pytest.raises(fshard.SpecError, match=r"^apply_module\(\): the forward replaced buffer 'calls', ") as info:
        apply_assigning(model)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("value", "got"),
    [(torch.zeros(2, dtype=torch.float64), "shape (3,), torch.float64"), (torch.zeros(3), "shape (3,), torch.float32")],
    ids=["dtype", "shape"],
)
def test_an_updated_buffer_keeps_its_shape_and_dtype(value: torch.Tensor, got: str) -> None:
    class Replacing(Assigning):
        def forward(self, xb: torch.Tensor) -> torch.Tensor:
            self.calls = torch.zeros(3, dtype=torch.float64 if self.calls.ndim else torch.float32)
            return self.lin(xb)

    with pytest.raises(fshard.SpecError, match=r"^apply_module\(\): the forward left buffer 'calls' holding ") as info:
        apply_assigning(Replacing("calls", value))
    assert got in str(info.value)


def test_a_rule_that_chunks_num_batches_tracked_names_it() -> None:
    with pytest.raises(fshard.SpecError, match=re.escape("buffer '1.num_batches_tracked' (shape (), torch.int64)")):
        fshard.shard_module(bn_model(), {"*": fshard.Chunk(0, RANKS)})


def test_buffers_that_no_rule_names_are_replicated_over_the_parameters_ranks() -> None:
    _, buffers = fshard.shard_module(
        bn_model(), {"*.weight": fshard.Chunk(0, [0, 1]), "*.bias": fshard.Replicated([0, 1])}
    )
    assert buffers["1.running_mean"].layout == fshard.Replicated([0, 1]).layout((6,))
    assert buffers["1.num_batches_tracked"].dtype == torch.int64


# -- rules ----------------------------------------------------------------------------------


def test_the_first_matching_pattern_wins() -> None:
    params, _ = fshard.shard_module(
        gpt(), {"blocks.*.fc.weight": fshard.Chunk(0, RANKS), "*": fshard.Replicated(RANKS)}
    )
    assert params["blocks.2.fc.weight"].layout == fshard.Chunk(0, RANKS).layout((2 * D, D))
    assert params["blocks.2.fc.bias"].layout.is_fully_replicated


def test_fully_sharded_replicates_what_is_too_small_to_split() -> None:
    params, _ = fshard.shard_module(torch.nn.Linear(8, 3), fshard.fully_sharded(RANKS))
    assert params["weight"].layout.is_fully_replicated  # 3 rows on 4 ranks
    params, _ = fshard.shard_module(torch.nn.Linear(3, 8), fshard.fully_sharded(RANKS))
    assert [tuple(s.data.shape) for s in params["weight"].addressable_shards] == [(2, 3)] * 4


@pytest.mark.parametrize("helper", [fshard.replicated, fshard.fully_sharded])
def test_a_rule_helper_given_one_int_asks_for_the_ranks(helper: Any) -> None:
    """fully_sharded(3) read as [3]: the whole model on rank 3, and no shard, nor error, on the others."""
    name = helper.__name__
    with pytest.raises(
        fshard.SpecError, match=re.escape(f"{name}() takes a sequence of ranks, got 3: give list(range(3))")
    ):
        helper(3)
    params, _ = fshard.shard_module(torch.nn.Linear(4, 2), helper("rank:1/cpu"))  # one placement, named as one
    assert params["weight"].layout.ranks == (1,)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        pytest.param(
            {"wte.*": fshard.Replicated(RANKS)}, "rules give no spec for parameter 'wpe.weight'", id="uncovered"
        ),
        pytest.param(
            {"blocks.9.*": fshard.Replicated(RANKS), "*": fshard.Replicated(RANKS)},
            "rule 'blocks.9.*' names no parameter or buffer of the module",
            id="names-nothing",
        ),
        pytest.param(
            {"*": fshard.Chunk(2, RANKS)}, "parameter 'wte.weight' (shape (16, 8), torch.float64)", id="does-not-fit"
        ),
    ],
)
def test_bad_rules_name_the_entry(rules, message: str) -> None:
    with pytest.raises(fshard.SpecError, match=re.escape(message)):
        fshard.shard_module(gpt(), rules)


def test_apply_module_refuses_parameters_of_another_module() -> None:
    params, buffers = fshard.shard_module(gpt(tie=False), fshard.replicated(RANKS))
    tokens, _ = batch(0)
    with pytest.raises(fshard.SpecError, match=re.escape("unexpected ['head.weight']")):
        fshard.apply_module(gpt(), params, buffers, fshard.shard(tokens, fshard.Chunk(0, RANKS)))


@pytest.mark.parametrize(("name", "shape"), [("bias", (1,)), ("weight", (3, 5))], ids=["broadcastable", "unfit"])
def test_apply_module_refuses_an_array_of_another_shape_naming_it(name: str, shape: tuple[int, ...]) -> None:
    model = torch.nn.Linear(4, 3)
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    params[name] = fshard.shard(torch.ones(shape), fshard.Replicated(RANKS))  # a (1,) bias would broadcast
    want = tuple(getattr(model, name).shape)
    refused = re.escape(f"params[{name!r}] has shape {shape}, where the Linear's parameter {name!r} has shape {want}")
    with pytest.raises(fshard.SpecError, match=refused):
        fshard.apply_module(model, params, buffers, fshard.shard(torch.randn(8, 4), fshard.Chunk(0, RANKS)))


def test_the_default_out_spec_follows_the_rows() -> None:
    model = gpt()
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(RANKS))
    tokens, _ = batch(0)
    out, _ = fshard.apply_module(model, params, buffers, fshard.shard(tokens, fshard.Chunk(0, RANKS)))
    assert out.layout == fshard.Chunk(0, RANKS).layout((BATCH, SEQ, VOCAB))
    torch.testing.assert_close(fshard.gather(out), model(tokens), rtol=0, atol=ATOL)


# -- resume, Gloo, the example --------------------------------------------------------------


def test_resume_on_2_ranks_from_a_checkpoint_saved_on_4() -> None:
    model, dense = gpt(reentrant=False), gpt(reentrant=False)
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(RANKS))
    fshard_steps(model, params, buffers, 2, RANKS)
    with tempfile.TemporaryDirectory() as path:
        fshard.save(path, {"params": params, "buffers": buffers})
        like = dict(zip(("params", "buffers"), fshard.shard_module(gpt(), fshard.fully_sharded([0, 1]))))
        tree = fshard.load(path, like=like)
    for t in (t for a in tree["params"].values() for t in a.addressable_data):
        t.requires_grad_()
    losses, _ = fshard_steps(model, tree["params"], tree["buffers"], 2, [0, 1], first_step=2)
    want = dense_steps(dense, 4)[2:]
    assert losses == pytest.approx(want, rel=0, abs=ATOL)
    assert_params_equal(tree["params"], dense)


def test_batchnorm_buffers_resume_on_2_ranks() -> None:
    model = bn_model()
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    x, y = bn_batch(0)
    _, buffers = bn_fshard_step(model, params, buffers, sgd(params), x, y, RANKS)
    with tempfile.TemporaryDirectory() as path:
        fshard.save(path, {"params": params, "buffers": buffers})
        like = dict(zip(("params", "buffers"), fshard.shard_module(bn_model(), fshard.replicated([0, 1]))))
        tree = fshard.load(path, like=like)
    for name, b in buffers.items():
        assert tree["buffers"][name].layout == fshard.Replicated([0, 1]).layout(b.shape)
        assert torch.equal(fshard.gather(tree["buffers"][name]), fshard.gather(b))


def _gloo_gpt(style: str) -> dict[str, object]:
    """On each rank: DP or FSDP of the checkpointed, tied GPT with per-rank rows (from_local_tensor)."""
    import torch.distributed as dist

    ranks = list(range(dist.get_world_size()))
    model = gpt(reentrant=False)
    params, buffers = fshard.shard_module(model, (fshard.replicated if style == "dp" else fshard.fully_sharded)(ranks))

    def rows(t: torch.Tensor) -> fshard.ShardedArray:
        return fshard.from_local_tensor(t.chunk(len(ranks))[dist.get_rank()].contiguous(), dim=0)

    losses, _ = fshard_steps(model, params, buffers, 3, ranks, rows=rows)
    return {"losses": losses, "params": {k: fshard.gather(a).detach() for k, a in params.items()}}


def _gloo_batchnorm() -> dict[str, object]:
    import torch.distributed as dist

    ranks = list(range(dist.get_world_size()))
    model = bn_model()
    params, buffers = fshard.shard_module(model, fshard.replicated(ranks))
    opt = sgd(params)
    for step in range(2):
        x, y = bn_batch(step)
        _, buffers = bn_fshard_step(model, params, buffers, opt, x, y, ranks)
    return {k: b.local_tensor() for k, b in buffers.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("style", ["dp", "fsdp"])
def test_gpt_on_4_gloo_processes_trains_like_the_dense_model(dist_pool, style: str) -> None:
    dense = gpt(reentrant=False)
    want = dense_steps(dense, 3)
    for got in dist_pool.run(_gloo_gpt, style, timeout=120):
        assert got["losses"] == pytest.approx(want, rel=0, abs=ATOL)
        for name, p in dense.named_parameters():
            torch.testing.assert_close(got["params"][name], p.detach(), rtol=0, atol=ATOL)


@pytest.mark.multiprocess
def test_batchnorm_buffers_on_4_gloo_processes_are_identical_and_match_local(dist_pool) -> None:
    model = bn_model()
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    opt = sgd(params)
    for step in range(2):
        x, y = bn_batch(step)
        _, buffers = bn_fshard_step(model, params, buffers, opt, x, y, RANKS)
    per_rank = dist_pool.run(_gloo_batchnorm, timeout=120)
    for name, b in buffers.items():
        assert all(torch.equal(r[name], per_rank[0][name]) for r in per_rank)
        torch.testing.assert_close(per_rank[0][name], fshard.gather(b), rtol=0, atol=ATOL)


def test_the_example_trains_dp_and_fsdp_like_the_dense_model() -> None:
    gpt_modules = example("gpt_modules")
    result = gpt_modules.check(range(4))
    assert result["ok"], result
    assert result["DP"] == pytest.approx(result["dense"], rel=0, abs=ATOL)


def test_the_example_program_is_at_most_25_lines() -> None:
    lines, _ = inspect.getsourcelines(example("gpt_modules").program)
    assert len(lines) <= 25


def _example_on_gloo() -> bool:
    import torch.distributed as dist

    return example("gpt_modules").check(range(dist.get_world_size()))["ok"]


@pytest.mark.multiprocess
def test_the_example_on_4_gloo_processes(dist_pool) -> None:
    assert dist_pool.run(_example_on_gloo, timeout=120) == [True] * 4


def test_the_structure_is_read_once_per_module_and_again_after_a_change() -> None:
    """The structure is read once per module object: a second call reuses it, a replaced tensor is seen."""
    from fshard._api.module_rules import structure

    model = gpt()
    first = structure(model)
    assert structure(model) is first
    model.head.weight = torch.nn.Parameter(copy.deepcopy(model.wte.weight.detach()))
    assert "head.weight" in structure(model).params


def test_the_structure_sees_a_tensor_replaced_under_the_same_name_and_a_new_buffer() -> None:
    from fshard._api.module_rules import structure

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    first = structure(model)
    model[0].bias = torch.nn.Parameter(torch.zeros(2))  # same name, another tensor
    second = structure(model)
    assert second is not first
    assert structure(model) is second
    model[0].register_buffer("scale", torch.ones(2))
    assert "0.scale" in structure(model).buffers


def test_a_parameter_whose_data_takes_another_shape_is_seen_by_the_next_apply() -> None:
    """Pruning a layer in place (``.data`` of another shape, the same Parameter): its new arrays are applied."""
    ranks = [0, 1]
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    lin = torch.nn.Linear(4, 4)
    fshard.shard_module(lin, fshard.replicated(ranks))  # reads the structure: weight (4, 4)
    lin.weight.data, lin.bias.data = lin.weight.data[:3].clone(), lin.bias.data[:3].clone()
    params, buffers = fshard.shard_module(lin, fshard.replicated(ranks))
    out, _ = fshard.apply_module(lin, params, buffers, fshard.shard(x, fshard.Chunk(0, ranks)))
    torch.testing.assert_close(fshard.gather(out), lin(x))
    assert tuple(out.shape) == (6, 3)


def test_the_clone_copies_each_submodule_as_copy_copy_does() -> None:
    """Each submodule of the clone holds what ``copy.copy`` would give it, less what the clone replaces."""
    from fshard._api.module_clone import functional_clone

    model = gpt()
    clone, copies = functional_clone(model, dict(model.named_parameters()), dict(model.named_buffers()))
    assert clone is copies[id(model)]
    for sub in model.modules():
        mine, theirs = vars(copies[id(sub)]), vars(copy.copy(sub))
        assert type(copies[id(sub)]) is type(sub)
        assert mine.keys() == theirs.keys()
        rebuilt = {"_parameters", "_buffers", "_modules"}
        assert all(mine[k] is theirs[k] for k in mine.keys() - rebuilt)
        assert all(mine[k] is not vars(sub)[k] for k in rebuilt)  # the module's own dicts stay its own


def test_the_clone_copies_modules_with_their_own_state_methods_and_compiled_ones_as_copy_copy_does() -> None:
    """Modules that copy their own way (``__setstate__``), and a compiled one, whose compiled call is left out."""
    from fshard._api.module_clone import functional_clone

    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.MultiheadAttention(4, 2, batch_first=True), torch.nn.LayerNorm(4)
    )
    model[0].compile()  # lazy: nothing compiles until a call
    assert "_compiled_call_impl" in vars(model[0])
    _, copies = functional_clone(model, dict(model.named_parameters()), dict(model.named_buffers()))
    for sub in model.modules():
        mine, theirs = vars(copies[id(sub)]), vars(copy.copy(sub))
        assert type(copies[id(sub)]) is type(sub)
        assert mine.keys() == theirs.keys()
        assert all(mine[k] is theirs[k] for k in mine.keys() - {"_parameters", "_buffers", "_modules"})
    assert "_compiled_call_impl" not in vars(copies[id(model[0])])


def test_apply_module_refuses_out_specs_shaped_otherwise_than_the_result() -> None:
    model, ranks = torch.nn.Linear(4, 3), [0, 1]
    params, buffers = fshard.shard_module(model, fshard.replicated(ranks))
    x = fshard.shard(torch.randn(6, 4), fshard.Chunk(0, ranks))
    rows, summed = fshard.Chunk(0, ranks), fshard.Partial(fshard.Replicated(ranks))

    def both(m: torch.nn.Module, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = m(xb)
        return y, y.sum()[None]

    where = r"apply_module\(\) out_specs does not match the module's results: its spec at \['out'\] would lay out"
    with pytest.raises(fshard.SpecError, match=where):
        fshard.apply_module(model, params, buffers, x, method=both, out_specs={"out": rows, "total": summed})
    out, total = fshard.apply_module(model, params, buffers, x, method=both, out_specs=(rows, summed))[0]
    assert (out.layout.partial, total.layout.partial) == (None, "sum")
    # One spec in a container for the one result, also beside the buffer updates that apply_module adds.
    bn = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    bn_params, bn_buffers = fshard.shard_module(bn, fshard.replicated(ranks))
    for one in ((rows,), {"out": rows}):
        got, new = fshard.apply_module(bn, bn_params, bn_buffers, x, out_specs=one)
        assert got.layout == rows.layout((6, 3))
        assert int(fshard.gather(new["1.num_batches_tracked"])) == 1


class TwoResults(torch.nn.Module):
    """A Linear, a BatchNorm when ``bn``, and two results: a tuple, or a dict when ``as_dict``."""

    def __init__(self, bn: bool, as_dict: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3) if bn else torch.nn.Identity()
        self.as_dict = as_dict

    def forward(self, xb: torch.Tensor) -> Any:
        h = self.bn(self.lin(xb))
        return {"h": h, "total": h.sum(1)} if self.as_dict else (h, h.sum(1))


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
@pytest.mark.parametrize("bn", ["no-buffers", "eval", "train"])
@pytest.mark.parametrize("one", ["default", "Chunk(0)"])
def test_one_out_spec_lays_out_every_tensor_of_a_tree_result(as_dict: bool, bn: str, one: str) -> None:
    """Also beside the buffer updates of a BatchNorm in training mode."""
    ranks = [0, 1]
    model = TwoResults(bn != "no-buffers", as_dict).train(bn == "train")
    params, buffers = fshard.shard_module(model, fshard.replicated(ranks))
    x = torch.randn(8, 4)
    kw = {} if one == "default" else {"out_specs": fshard.Chunk(0, ranks)}
    out, new = fshard.apply_module(model, params, buffers, fshard.shard(x, fshard.Chunk(0, ranks)), **kw)
    h, total = (out["h"], out["total"]) if as_dict else out
    assert h.layout == fshard.Chunk(0, ranks).layout((8, 3))
    assert total.layout == fshard.Chunk(0, ranks).layout((8,))
    if bn == "train":
        assert int(fshard.gather(new["bn.num_batches_tracked"])) == 1
    else:
        want = model(x)
        torch.testing.assert_close(fshard.gather(h), want["h"] if as_dict else want[0], rtol=0, atol=1e-6)


def test_out_specs_that_do_not_fit_the_result_count_only_its_tensors() -> None:
    """The buffer updates that apply_module carries are none of the caller's business."""
    ranks = [0, 1]
    model = TwoResults(bn=True, as_dict=False)
    params, buffers = fshard.shard_module(model, fshard.replicated(ranks))
    rows = fshard.Chunk(0, ranks)
    with pytest.raises(fshard.SpecError, match=r"^apply_module\(\) out_specs has 3 specs but .* returned 2 tensors"):
        fshard.apply_module(model, params, buffers, fshard.shard(torch.randn(8, 4), rows), out_specs=(rows,) * 3)


def test_apply_module_errors_name_what_its_caller_passed() -> None:
    """Its refusals name apply_module, the forward's argument and its own fix, not its inner shard_map's."""
    model, ranks = torch.nn.Linear(4, 3), [0, 1]
    params, buffers = fshard.shard_module(model, fshard.replicated(ranks))
    x = fshard.shard(torch.randn(6, 4), fshard.Chunk(0, ranks))
    with pytest.raises(fshard.SpecError, match=r"^apply_module\(\) out_spec .* but forward argument 0 gives") as info:
        fshard.apply_module(model, params, buffers, x, out_specs=fshard.Replicated(ranks))
    assert "run the module through fshard.shard_map(..., check_vma=False)" in str(info.value)
    summed = fshard.shard(torch.randn(6, 4), fshard.Partial(fshard.Chunk(0, ranks)))
    with pytest.raises(fshard.SpecError, match=r"^apply_module\(\) forward argument 0 is a pending sum") as info:
        fshard.apply_module(model, params, buffers, summed, out_specs=fshard.Chunk(0, ranks))
    assert "linear=True" not in str(info.value)  # apply_module takes no linear=
    with pytest.raises(fshard.SpecError, match=r"^shard_map\(\) argument 0 is a pending sum") as info:
        fshard.shard_map(torch.neg, in_specs=fshard.Partial(fshard.Chunk(0, ranks)), out_specs=fshard.Chunk(0, ranks))(
            summed
        )
    assert "linear=True" not in str(info.value)  # nor does shard_map
    with pytest.raises(TypeError, match=r"^apply_module\(\) regather must be a bool, got 1"):
        fshard.apply_module(model, params, buffers, x, regather=1)


class _Counted(torch.nn.Linear):
    """A module whose copy goes through its own ``__copy__``: the clone must call it."""

    def __copy__(self) -> _Counted:
        out = _Counted.__new__(_Counted)
        out.__dict__.update(self.__dict__)
        out.__dict__["copied_by_hook"] = True
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.__dict__.get("copied_by_hook"), "the clone was not made by the class's __copy__"
        return super().forward(x)


class _Stated(torch.nn.Linear):
    """A module that restores its state through its own ``__setstate__``: the clone must call it."""

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self.__dict__["restored"] = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.__dict__.get("restored"), "the clone skipped the class's __setstate__"
        return super().forward(x)


@pytest.mark.parametrize("cls", [_Counted, _Stated])
def test_a_module_with_its_own_copy_protocol_is_copied_through_it(cls: type[torch.nn.Linear]) -> None:
    torch.manual_seed(0)
    module = cls(3, 2)
    params, buffers = fshard.shard_module(module, fshard.replicated(RANKS))
    x = torch.randn(8, 3)
    out, _ = fshard.apply_module(module, params, buffers, fshard.shard(x, fshard.Chunk(0, RANKS)))
    torch.testing.assert_close(fshard.gather(out), F.linear(x, module.weight, module.bias))  # not module(x): its hook


def test_a_module_compiled_in_place_runs_uncompiled_in_the_clone() -> None:
    """As ``copy.copy`` of a module does (``Module.__getstate__``), the clone leaves a compiled forward behind."""
    from fshard._api.module_clone import functional_clone

    model = torch.nn.Linear(2, 2)
    vars(model)["_compiled_call_impl"] = lambda *a, **k: pytest.fail("the compiled forward ran")
    clone, _ = functional_clone(model, dict(model.named_parameters()), {})
    assert "_compiled_call_impl" not in vars(clone)
    assert "_compiled_call_impl" not in vars(copy.copy(model))
    torch.testing.assert_close(clone(torch.ones(1, 2)), model.weight.sum(1)[None] + model.bias)


def _gloo_module_on_rank_0(style: str) -> dict[str, object]:
    """On each rank: a module whose parameters rank 0 alone holds, one step's loss and rank 0's gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    params, _ = fshard.shard_module(model, (fshard.replicated if style == "dp" else fshard.fully_sharded)([0]))
    x = fshard.shard(torch.randn(16, 8), fshard.Chunk(0, [0]))
    total, _ = fshard.apply_module(
        model,
        params,
        {},
        x,
        method=lambda m, xb: m(xb).square().sum()[None],
        out_specs=fshard.Partial(fshard.Replicated([0])),
    )
    loss = fshard.backward(total / 64)
    return {
        "requires_grad": [a.requires_grad for a in params.values()],
        "loss": loss,
        "grads": {k: [t.grad for t in a.addressable_data] for k, a in params.items()},
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("style", ["dp", "fsdp"])
def test_a_rank_that_holds_no_parameter_takes_part_in_the_step(dist_pool, style: str) -> None:
    """shard_module's arrays require grad on every rank, also where a rank holds none of their shards."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    want = model(x).square().sum() / 64
    want.backward()
    per_rank = dist_pool.run(_gloo_module_on_rank_0, style, timeout=120)
    for r, got in enumerate(per_rank):
        assert got["requires_grad"] == [True, True], r
        torch.testing.assert_close(got["loss"], want.detach().reshape(1), rtol=0, atol=ATOL)
    for name, p in model.named_parameters():
        (grad,) = per_rank[0]["grads"][name]
        torch.testing.assert_close(grad, p.grad, rtol=0, atol=ATOL)
        assert all(got["grads"][name] == [] for got in per_rank[1:])


@pytest.mark.parametrize("rules", ["replicated", "fully_sharded"])
def test_apply_module_with_a_precision_is_shard_map_with_it_on_the_parameters(rules: str) -> None:
    """bf16 blocks in the body and on the wire, gradients summed in fp32 and returned in the parameters' fp32."""
    from fshard.backends.local import LocalBackend

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    mixed = fshard.Precision(param=torch.bfloat16, reduce=torch.float32)
    x = torch.randn(16, 8)
    got: dict[str, list[torch.Tensor]] = {}
    seen: list[torch.dtype] = []
    for way in ("apply_module", "shard_map"):
        backend = LocalBackend()
        params, _ = fshard.shard_module(model, getattr(fshard, rules)(RANKS), backend=backend)
        xs = fshard.shard(x.to(torch.bfloat16), fshard.Chunk(0, RANKS), backend=backend)
        backend.counters.reset()
        if way == "apply_module":

            def loss(m: torch.nn.Module, xb: torch.Tensor) -> torch.Tensor:
                seen.append(m.weight.dtype)
                return m(xb).float().square().sum()[None]

            total, _ = fshard.apply_module(
                model, params, {}, xs, method=loss, out_specs=fshard.Partial(fshard.Replicated(RANKS)), precision=mixed
            )
        else:
            every = fshard.Replicated(RANKS)
            total = fshard.shard_map(
                lambda w, b, xb: F.linear(xb, w, b).float().square().sum()[None],
                in_specs=(every, every, fshard.Chunk(0, RANKS)),
                out_specs=fshard.Partial(every),
                precision=(mixed, mixed, None),
            )(params["weight"], params["bias"], xs)
        sent = backend.counters.bytes_sent
        fshard.backward(total)
        got[way] = [t.grad for a in params.values() for t in a.addressable_data]
        got[way + " sent"] = [torch.tensor(sent)]
    assert seen == [torch.bfloat16] * 4
    assert all(g.dtype == torch.float32 for g in got["apply_module"])
    assert all(torch.equal(a, b) for a, b in zip(got["apply_module"], got["shard_map"], strict=True))
    assert torch.equal(got["apply_module sent"][0], got["shard_map sent"][0])
    if rules == "fully_sharded":  # the gather of the 8x4 weight and the bias, each rank lacking 3/4: bf16 bytes
        assert int(got["apply_module sent"][0]) == 4 * 3 * (8 * 4 + 4) // 4 * 2


def test_apply_module_refuses_a_precision_that_is_not_one() -> None:
    model = torch.nn.Linear(4, 2)
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    x = fshard.shard(torch.randn(8, 4), fshard.Chunk(0, RANKS))
    with pytest.raises(TypeError, match=r"apply_module\(\) precision= takes an fshard\.Precision"):
        fshard.apply_module(model, params, buffers, x, precision=torch.bfloat16)


def test_a_pending_sum_as_input_is_refused_with_or_without_out_specs():
    """Without out_specs too, the error is the argument's (it names the reduction to make), not the result's layout."""
    ranks = [0, 1]
    model = torch.nn.Linear(2, 2)
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(ranks))
    summed = fshard.Partial(fshard.Replicated(ranks))
    x = fshard.reshard(fshard.shard(torch.ones(4, 2), fshard.Replicated(ranks)), summed)
    for kw in ({}, {"out_specs": summed}):
        with pytest.raises(fshard.SpecError, match=r"forward argument 0 is a pending sum \(Partial\)"):
            fshard.apply_module(model, params, buffers, x, **kw)


def test_a_lazy_module_is_refused_naming_its_parameter_until_its_first_forward() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LazyLinear(4))
    lazy = "is an uninitialized parameter or buffer of a lazy module"
    for make, named in (
        (lambda: fshard.shard_module(model, fshard.replicated(RANKS)), "'1.weight' "),
        (lambda: fshard.shard_params(model, lambda name, t: fshard.Replicated(RANKS)), "'1.weight' "),
        (lambda: fshard.shard(model[1].weight, fshard.Replicated(RANKS)), "shard() input "),
        (lambda: fshard.shard({"w": model[1].weight}, fshard.Replicated(RANKS)), "shard() input at ('w',) "),
    ):
        with pytest.raises(fshard.SpecError, match=re.escape(named + lazy) + ".*run the module once"):
            make()
    x = torch.randn(2, 3)
    want = model(x)  # the first forward gives the lazy layer its shapes
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    out, _ = fshard.apply_module(model, params, buffers, fshard.shard(x, fshard.Chunk(0, RANKS)))
    torch.testing.assert_close(fshard.gather(out), want)


def _one_rank_in_eval_mode(rank_in_eval: int | None) -> str:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    params, buffers = fshard.shard_module(model, fshard.replicated(RANKS))
    if dist.get_rank() == rank_in_eval:
        model.eval()
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    try:
        out, _ = fshard.apply_module(model, params, buffers, fshard.shard(x, fshard.Chunk(0, RANKS)))
        return str(fshard.gather(out).sum().item())
    except fshard.CollectiveMismatchError as exc:
        return str(exc)


@pytest.mark.multiprocess
def test_ranks_whose_modules_differ_in_train_or_eval_mode_raise_naming_it(dist_pool) -> None:
    """The buffers a forward updates depend on each submodule's mode; ranks that differ moved different buffers
    after the call, and raised a mismatch of movements that named neither the mode nor the buffers."""
    got = dist_pool.run(_one_rank_in_eval_mode, 1, timeout=120)
    updates = "differ in the buffers the module's forward updates, which each submodule's train() or eval() mode"
    assert all(updates in m and "call model.train() or model.eval() alike on every rank" in m for m in got), got
    assert "this rank's: ['1.running_mean', '1.running_var', '1.num_batches_tracked']" in got[0]
    assert "this rank's: []" in got[1]
    fine = dist_pool.run(_one_rank_in_eval_mode, None, timeout=120)  # the group still works
    assert len(set(fine)) == 1, fine
    assert "differ" not in fine[0], fine
