"""``shard_map`` over pytree arguments: a dict of parameters, a tuple of a batch and its targets.

A tree argument takes one spec for all its leaves or a tree of specs that is a prefix of it
(JAX's ``shard_map``). It must give exactly what passing the same leaves one by one gives:
the same values and gradients, bit for bit, and across processes the same collectives.
"""

from __future__ import annotations

import collections

import pytest
import torch

import fshard
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist import TorchDistBackend

R = [0, 1]
REP, ROWS = fshard.Replicated(R), fshard.Chunk(0, R)


def _params(backend=None, w_spec=ROWS, b_spec=REP) -> dict[str, fshard.ShardedArray]:
    """Two parameters as a dict of arrays whose shards take gradients: ``w`` (3x2) and ``b`` (2)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)
    out = {"w": fshard.shard(w, w_spec, backend=backend), "b": fshard.shard(b, b_spec, backend=backend)}
    for a in out.values():
        for t in a.addressable_data:
            t.requires_grad_()
    return out


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)


def _grads(params: dict[str, fshard.ShardedArray]) -> list[torch.Tensor]:
    return [t.grad for a in params.values() for t in a.addressable_data]


def _loss(p, xy):
    x, y = xy
    return ((x @ p["w"] + p["b"] - y) ** 2).sum()[None]


def test_a_dict_and_a_tuple_give_the_values_and_gradients_of_their_leaves_passed_one_by_one():
    x, y = _batch()
    by_tree = _params()
    tree = fshard.shard_map(_loss, in_specs=(REP, (ROWS, ROWS)), out_specs=fshard.Partial(REP))
    fshard.gather(tree(by_tree, (x, y))).sum().backward()

    by_leaf = _params()
    flat = fshard.shard_map(
        lambda w, b, xb, yb: _loss({"w": w, "b": b}, (xb, yb)),
        in_specs=(REP, REP, ROWS, ROWS),
        out_specs=fshard.Partial(REP),
    )
    loss = fshard.gather(flat(by_leaf["w"], by_leaf["b"], x, y))
    loss.sum().backward()
    assert torch.equal(fshard.gather(tree(by_tree, (x, y))), loss)
    assert all(torch.equal(a, b) for a, b in zip(_grads(by_tree), _grads(by_leaf)))
    assert all(g is not None for g in _grads(by_tree))


def test_a_tree_of_specs_lays_out_each_leaf_and_other_leaves_pass_unchanged():
    x, _ = _batch()
    seen = {}

    def body(p, batch):
        seen.update(shapes=(tuple(p["w"].shape), tuple(batch["x"].shape)), rest=(p["n"], p["none"], batch["tag"]))
        return batch["x"] @ p["w"] * p["n"]

    f = fshard.shard_map(
        body,
        in_specs=({"w": REP, "n": None, "none": None}, {"x": ROWS, "tag": None}),
        out_specs=ROWS,
    )
    p = _params()
    out = f({"w": p["w"], "n": 2, "none": None}, {"x": x, "tag": "rows"})
    assert seen == {"shapes": ((3, 2), (2, 3)), "rest": (2, None, "rows")}
    torch.testing.assert_close(fshard.gather(out), x @ fshard.gather(p["w"]) * 2, rtol=0, atol=1e-12)


def test_one_spec_reaches_every_leaf_of_nested_containers_of_any_kind():
    Pair = collections.namedtuple("Pair", "a b")
    t = torch.arange(8.0).reshape(4, 2)
    f = fshard.shard_map(
        lambda tree: tree["pair"].a + tree["list"][0] * tree["pair"].b, in_specs=ROWS, out_specs=ROWS
    )  # fmt: skip
    out = f({"pair": Pair(t, t + 1), "list": [t * 2]})
    assert torch.equal(fshard.gather(out), t + 2 * t * (t + 1))


def test_structures_that_change_between_calls_each_work():
    f = fshard.shard_map(lambda p: sum(p.values()), in_specs=REP, out_specs=REP)
    p = _params()
    assert torch.equal(fshard.gather(f({"b": p["b"]})), fshard.gather(p["b"]))
    assert torch.equal(fshard.gather(f({"b": p["b"], "c": p["b"]})), 2 * fshard.gather(p["b"]))


def test_a_precision_per_argument_reaches_the_leaves_of_its_tree():
    mixed = fshard.Precision(param=torch.float32)
    seen = []
    f = fshard.shard_map(
        lambda p, xb: seen.append((p["w"].dtype, xb.dtype)) or (xb.float() @ p["w"]).sum()[None],
        in_specs=(REP, ROWS),
        out_specs=fshard.Partial(REP),
        precision=(mixed, None),
    )
    x, _ = _batch()
    p = _params()
    fshard.gather(f(p, x)).sum().backward()
    assert set(seen) == {(torch.float32, torch.float64)}
    assert all(t.grad.dtype == torch.float64 for t in p["w"].addressable_data)


def test_specs_that_do_not_fit_the_tree_name_both_structures():
    p = _params()
    f = fshard.shard_map(lambda q: q["w"], in_specs=({"w": REP, "v": REP},), out_specs=REP)
    with pytest.raises(
        fshard.SpecError, match=r"argument 0 does not fit it: the specs are shaped .*'v'.* the argument .*'b'"
    ):
        f(p)
    with pytest.raises(fshard.SpecError, match=r"argument 0 does not fit it") as info:
        fshard.shard_map(lambda q: q[0], in_specs=((REP, REP),), out_specs=REP)([p["w"], p["b"], p["b"]])
    assert "tensor(" not in str(info.value)  # structures, not values
    assert "values=" not in str(info.value)


def test_an_array_leaf_whose_spec_is_none_is_named_by_its_path():
    p = _params()
    f = fshard.shard_map(lambda q: q["w"], in_specs=({"w": REP, "b": None},), out_specs=REP)
    with pytest.raises(fshard.SpecError, match=r"argument 0\['b'\] is a ShardedArray but its in_spec is None"):
        f(p)


def test_arguments_whose_spec_is_none_pass_as_they_are_each_call():
    """Beside arrays, a None-spec argument reaches fn as given at each call (its array's targets cached once)."""
    p = _params()
    f = fshard.shard_map(lambda w, c, b: w * c + b.sum(), in_specs=(ROWS, None, REP), out_specs=ROWS)
    for c in (2.0, 3.0):
        torch.testing.assert_close(
            fshard.gather(f(p["w"], c, p["b"])), fshard.gather(p["w"]) * c + fshard.gather(p["b"]).sum()
        )
    for wrong in (torch.ones(2), p["b"]):
        with pytest.raises(fshard.SpecError, match=r"argument 1 is a (Tensor|ShardedArray) but its in_spec is None"):
            f(p["w"], wrong, p["b"])


def test_errors_of_the_leaves_name_the_leaf():
    t = torch.ones(4, 2)
    f = fshard.shard_map(lambda q: q["w"], in_specs=({"w": fshard.Replicated([0]), "v": REP},), out_specs=REP)
    with pytest.raises(fshard.SpecError, match=r"argument 0\['w'\]") as info:
        f({"w": t, "v": t})  # placement 1 would get no block of w
    assert "where argument 0['v'] has one" in str(info.value)


def test_a_tree_of_specs_matches_an_ordered_dict_by_key_not_by_order():
    seen = {}

    def body(p):
        seen.update({k: tuple(v.shape) for k, v in p.items()})
        return p["w"]

    rows_and_copies = {"w": ROWS, "b": REP}  # a dict's order is not the argument's
    f = fshard.shard_map(body, in_specs=(rows_and_copies,), out_specs=ROWS)
    f(collections.OrderedDict(w=torch.ones(4, 2), b=torch.ones(4, 2)))
    assert seen == {"w": (2, 2), "b": (4, 2)}
    g = fshard.shard_map(body, in_specs=(collections.OrderedDict(b=REP, w=ROWS),), out_specs=ROWS)
    seen.clear()
    g({"w": torch.ones(4, 2), "b": torch.ones(4, 2)})
    assert seen == {"w": (2, 2), "b": (4, 2)}


def test_each_call_gets_its_own_dicts_order():
    f = fshard.shard_map(lambda d: torch.cat(list(d.values()), 1), in_specs=REP, out_specs=REP)
    zeros, ones = torch.zeros(2, 2), torch.ones(2, 2)
    first = fshard.gather(f({"a": ones, "b": zeros}))
    second = fshard.gather(f({"b": zeros, "a": ones}))  # the same keys in another order: the same structure
    assert first[0].tolist() == [1, 1, 0, 0]
    assert second[0].tolist() == [0, 0, 1, 1]


def test_a_precision_reaches_the_floating_leaves_of_its_tree_only():
    seen = []
    f = fshard.shard_map(
        lambda p: seen.append((p["w"].dtype, p["n"].dtype)) or p["w"],
        in_specs=REP,
        out_specs=REP,
        precision=fshard.Precision(param=torch.bfloat16),
    )
    f({"w": torch.ones(2), "n": torch.tensor([3])})  # a counter (num_batches_tracked) beside a weight
    assert set(seen) == {(torch.bfloat16, torch.int64)}
    seen.clear()
    f({"w": torch.ones(2), "n": torch.tensor([3.0])})  # the same structure, a floating leaf: its precision too
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}


R4 = [0, 1, 2, 3]


def _step4(params, x, y):
    """A data-parallel step over 4 ranks with the parameters as one dict: the loss, and each leaf's gradient."""
    rep = fshard.Replicated(R4)
    f = fshard.shard_map(_loss, in_specs=(rep, (fshard.Chunk(0, R4),) * 2), out_specs=fshard.Partial(rep))
    loss = fshard.gather(f(params, (x, y)))
    loss.sum().backward()
    return loss.detach(), [a.addressable_data[0].grad for a in params.values()]


def _params4(backend=None) -> dict[str, fshard.ShardedArray]:
    return _params(backend, fshard.Replicated(R4), fshard.Replicated(R4))


def _batch4() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64)


def _on_rank() -> tuple[torch.Tensor, list[torch.Tensor], int, torch.Tensor, list[torch.Tensor], int]:
    backend = TorchDistBackend()
    x, y = (t.chunk(4)[backend.rank] for t in _batch4())
    xs, ys = fshard.from_local_tensor((x, y), dim=0, even=True)
    p = _params4()
    before = backend.counters.collectives
    tree_loss, tree_grads = _step4(p, xs, ys)
    n_tree = backend.counters.collectives - before
    q = _params4()
    rep = fshard.Replicated(R4)
    flat = fshard.shard_map(
        lambda b, w, xb, yb: _loss({"w": w, "b": b}, (xb, yb)),
        in_specs=(rep, rep, fshard.Chunk(0, R4), fshard.Chunk(0, R4)),
        out_specs=fshard.Partial(rep),
    )
    before = backend.counters.collectives
    loss = fshard.gather(flat(q["b"], q["w"], xs, ys))  # a dict's leaves in optree's order: sorted keys
    loss.sum().backward()
    n_flat = backend.counters.collectives - before
    flat_grads = [a.addressable_data[0].grad for a in q.values()]
    return tree_loss, tree_grads, n_tree, loss.detach(), flat_grads, n_flat


@pytest.mark.multiprocess
def test_across_processes_a_tree_moves_and_sums_as_its_leaves_do(dist_pool):
    backend = LocalBackend(world_size=4)
    x, y = (fshard.shard(t, fshard.Chunk(0, R4), backend=backend) for t in _batch4())
    want_loss, want_grads = _step4(_params4(backend), x, y)
    for tree_loss, tree_grads, n_tree, flat_loss, flat_grads, n_flat in dist_pool.run(_on_rank, timeout=120):
        assert torch.equal(tree_loss, flat_loss)  # as the leaves one by one, bit for bit
        assert n_tree == n_flat
        assert all(torch.equal(a, b) for a, b in zip(tree_grads, flat_grads))
        torch.testing.assert_close(tree_loss, want_loss, rtol=0, atol=1e-12)  # as on the local backend
        for got, want in zip(tree_grads, want_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
