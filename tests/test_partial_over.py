"""``Partial(spec, op, over=axes)``: pending reductions whose summands have replicas.

On a (dp, tp) mesh, ``Partial(Named(mesh, (None,)), over="tp")`` is DTensor's
``[Replicate(), Partial()]``: the copies along tp are summands, those along dp replicas
of them. Checked here on the local backend: the spec and its errors, the layout's terms
(canonical form, round trips, pictures, validation), the values (a sum over tp only), the
plans (one read per summand, exact element counts, senders along tp), the operators,
gradients against dense float64 ones, JAX's matmul-reduce-scatter through shard_map, and
checkpoints refusing a pending sum.
"""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
import torch

import fshard
from fshard import Chunk, Layout, Mesh, Named, Partial, Replicated, Single
from fshard._api.move import split_replicas
from fshard._layout.layout import replica_ids, with_partial, with_terms
from fshard._layout.show import describe_layout
from fshard.backends.torch_dist._reduce_collective import collective_kind

MESH = Mesh((2, 2), axis_names=("dp", "tp"))
OVER_TP = Partial(Named(MESH, (None,)), over="tp")  # [Replicate(), Partial()]
EVERY = Partial(Named(MESH, (None,)))  # every copy a summand: [Partial(), Partial()]
SHAPE = (8, 6)
BASE = torch.arange(48.0, dtype=torch.float64).reshape(SHAPE)


def _summands(spec: Partial, base: torch.Tensor = BASE) -> fshard.ShardedArray:
    """A pending sum under ``spec`` whose copy on mesh position (dp, tp) holds (tp + 1) * base."""
    layout = spec.layout(tuple(base.shape))
    shards = []
    for m in layout.shards:
        box = tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))
        shards.append(fshard.Shard(m, (m.placement.rank % 2 + 1) * base[box]))
    return fshard.from_local_shards_and_layout(shards, layout)


# -- the spec --------------------------------------------------------------------------------


def test_over_takes_a_name_or_a_tuple_and_takes_part_in_equality():
    assert Partial(Named(MESH, (None,)), over="tp") == Partial(Named(MESH, (None,)), over=("tp",))
    assert hash(Partial(Named(MESH, (None,)), over="tp")) == hash(Partial(Named(MESH, (None,)), over=["tp"]))
    assert OVER_TP != EVERY
    assert OVER_TP.over == ("tp",)
    assert EVERY.over is None
    assert repr(OVER_TP).endswith("op='sum', over=('tp',))")


BAD_OVER = {
    "replicated": (lambda: Partial(Replicated([0, 1]), over="x"), "needs a Named spec"),
    "chunk": (lambda: Partial(Chunk(0, [0, 1]), over="x"), "needs a Named spec"),
    "layout": (lambda: Partial(Named(MESH, (None,)).layout((2,)), over="dp"), "needs a Named spec"),
    "unknown axis": (lambda: Partial(Named(MESH, (None,)), over="x"), "the mesh has no axis 'x'; its axes are"),
    "axis that splits a dim": (lambda: Partial(Named(MESH, ("tp",)), over="tp"), "mesh axis 'tp' splits a dim"),
    "axis named twice": (lambda: Partial(Named(MESH, (None,)), over=("tp", "tp")), "names a mesh axis twice"),
    "no axis": (lambda: Partial(Named(MESH, (None,)), over=()), "takes mesh axis names of ('dp', 'tp')"),
    "not a name": (lambda: Partial(Named(MESH, (None,)), over=(1,)), "takes mesh axis names of ('dp', 'tp')"),
}


@pytest.mark.parametrize("case", list(BAD_OVER))
def test_bad_over_raises_naming_the_value_and_the_fix(case):
    make, message = BAD_OVER[case]
    with pytest.raises(fshard.SpecError, match=re.escape(message)):
        make()


# -- the layout's terms ----------------------------------------------------------------------


def test_copies_along_over_are_summands_and_the_others_replicas():
    layout = OVER_TP.layout(SHAPE)
    assert layout.partial == "sum"
    assert layout.terms.tolist() == [0, 1, 0, 1]  # ranks (dp, tp) in mesh order: the term is tp
    assert replica_ids(layout).tolist() == [0, 1, 0, 1]
    assert Partial(Named(MESH, (None,)), over="dp").layout(SHAPE).terms.tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="read-only"):
        layout.terms[0] = 1


def test_over_every_unused_axis_is_the_old_spelling():
    both = Partial(Named(MESH, (None,)), over=("dp", "tp")).layout(SHAPE)
    assert both.terms is None
    assert both == EVERY.layout(SHAPE)
    # Rows split over dp: each box has one copy per tp, so every copy is a summand.
    assert Partial(Named(MESH, ("dp",)), over="tp").layout(SHAPE) == Partial(Named(MESH, ("dp",))).layout(SHAPE)


def test_a_3d_mesh_numbers_each_boxes_summands_in_order():
    mesh = Mesh((2, 2, 2))
    layout = Partial(Named(mesh, ("z", None)), over="y").layout((8, 8))
    assert layout.terms.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]  # shard (x, y, z): term y
    assert replica_ids(layout).tolist() == [0, 2, 1, 3, 0, 2, 1, 3]


def test_terms_are_canonical():
    shards = [((0,), (3,), r) for r in range(4)]
    a = Layout((3,), shards, "sum", terms=[7, 5, 7, 5])
    assert a.terms.tolist() == [0, 1, 0, 1]
    assert a == Layout((3,), shards, "sum", terms=np.array([0, 1, 0, 1], np.int32))
    assert hash(a) == hash(Layout((3,), shards, "sum", terms=[0, 1, 0, 1]))
    assert Layout((3,), shards, "sum", terms=[3, 2, 1, 0]).terms is None  # no two copies are replicas
    assert Layout((3,), shards, "sum", terms=[3, 2, 1, 0]) == Layout((3,), shards, "sum")
    assert a != Layout((3,), shards, "sum")
    assert a != Layout((3,), shards, "sum", terms=[0, 0, 1, 1])


def test_terms_round_trip_through_dict_json_pickle_repr_and_from_arrays():
    layout = OVER_TP.layout(SHAPE)
    d = layout.to_dict()
    assert d["partial"] == "sum"
    assert d["terms"] == [0, 1, 0, 1]
    assert Layout.from_dict(json.loads(json.dumps(d))) == layout
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert repr(layout).endswith("partial='sum', terms=[0, 1, 0, 1])")
    assert eval(repr(layout), {"Layout": Layout}) == layout
    lo, sz, rank, _ = layout.columns
    assert Layout.from_arrays(SHAPE, lo, sz, rank, partial="sum", terms=[0, 1, 0, 1]) == layout
    assert "terms" not in EVERY.layout(SHAPE).to_dict()


def test_a_large_layouts_repr_counts_its_summands():
    mesh = Mesh((40, 2), axis_names=("dp", "tp"))
    layout = Partial(Named(mesh, (None,)), over="tp").layout((4,))
    assert repr(layout) == "Layout(shape=(4,), 80 shards on ranks 0-79, partial='sum', up to 2 summands per box)"


def test_the_picture_says_which_copies_are_summands():
    text = OVER_TP.layout((2, 4)).visualize(width=20)
    assert text.splitlines()[-1] == (
        "(pending sum of summands; the ranks in braces hold replicas of one summand: [0:2, 0:4]: {r0,r2} + {r1,r3})"
    )
    assert EVERY.layout((2, 4)).visualize(width=20).splitlines()[-1] == (
        "(pending sum: each element is the sum of its copies)"
    )
    assert " partial sum over terms: " in describe_layout(OVER_TP.layout((2, 4)))
    assert describe_layout(OVER_TP.layout((2, 4))) != describe_layout(EVERY.layout((2, 4)))


BAD_TERMS = {
    "without a pending reduction": (None, [0, 1, 0, 1], "marks the summands of a pending reduction, but partial is"),
    "too short": ("sum", [0, 1], "must be one int per shard (4 of them), got shape (2,)"),
    "not ints": ("sum", [0.5, 1, 0, 1], "must be one int per shard (4 of them), got dtype float64"),
    "summands sharing some ranks": (
        "sum",
        [0, 0, 1, 1],
        "summand 1 is held by ranks [1, 2] and summand 0 by ranks [0, 2]: summands of a box that share a rank "
        "must be held by the same ranks. Give such copies one term, or place the summands on different ranks.",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TERMS))
def test_bad_terms_raise_naming_the_value_and_the_fix(case):
    partial, terms, message = BAD_TERMS[case]
    # Rank 2 holds the box twice (two devices): with terms [0, 0, 1, 1], summand 0 on ranks 0
    # and 2 and summand 1 on ranks 2 and 1 share rank 2 but not rank 0.
    shards = [((0,), (3,), 0), ((0,), (3,), 2), ((0,), (3,), "rank:2/cuda:0"), ((0,), (3,), 1)]
    with pytest.raises(fshard.LayoutError, match=re.escape(message)):
        Layout((3,), shards, partial, terms=terms)


def test_dropping_the_reduction_drops_the_terms_and_changing_its_op_keeps_them():
    layout = OVER_TP.layout(SHAPE)
    plain = with_partial(layout, None)
    assert plain.terms is None
    assert plain == Named(MESH, (None,)).layout(SHAPE)
    assert with_partial(layout, "max").terms.tolist() == [0, 1, 0, 1]
    assert with_partial(layout, "max") == Partial(Named(MESH, (None,)), "max", over="tp").layout(SHAPE)
    assert with_terms(layout, None) == EVERY.layout(SHAPE)
    assert with_terms(EVERY.layout(SHAPE), [0, 1, 0, 1]) == layout


# -- values ----------------------------------------------------------------------------------


def test_gather_sums_over_tp_only():
    assert torch.equal(fshard.gather(_summands(OVER_TP)), 3 * BASE)  # (1 + 2), once per dp row


def test_the_old_spelling_on_a_2d_mesh_sums_every_copy():
    # The same copies read as four summands: each dp row counted again.
    assert torch.equal(fshard.gather(_summands(EVERY)), 6 * BASE)


@pytest.mark.parametrize("target", [Chunk(0, [0, 1, 2, 3]), Replicated([0, 1, 2, 3]), Single(3),
                                    Named(MESH, ("tp",)), Named(MESH, ("dp", "tp")), EVERY])  # fmt: skip
def test_reshard_reduces_over_tp_only(target):
    y = fshard.reshard(_summands(OVER_TP), target)
    assert torch.equal(fshard.gather(y), 3 * BASE)
    assert y.layout == target.layout(SHAPE)


def test_a_value_made_partial_over_tp_keeps_it_in_one_summand_on_every_replica():
    x = fshard.reshard(fshard.shard(BASE, Replicated([0, 1, 2, 3])), OVER_TP)
    assert [float(s.data.abs().sum()) for s in x.addressable_shards] == [float(BASE.sum()), 0.0] * 2
    assert torch.equal(fshard.gather(x), BASE)
    assert torch.equal(fshard.gather(fshard.shard(BASE, OVER_TP)), BASE)


# -- plans -----------------------------------------------------------------------------------

N = 48
PLANS = {
    # (source, destination, elements sent)
    "reduce-scatter over tp": (OVER_TP, Chunk(0, [0, 1, 2, 3]), N),  # 2 summands, 1 owner: one crosses
    "all-reduce over tp": (OVER_TP, Replicated([0, 1, 2, 3]), 4 * N),  # 2 + 4 - 1 - 1 per element
    "to rows over tp": (OVER_TP, Named(MESH, ("tp",)), 2 * N),  # 2 + 2 - 1 - 1 for half the elements each
    "reduce to one rank": (OVER_TP, Single(3), N),
    "every copy a summand": (OVER_TP, EVERY, 0),  # one replica keeps each summand
    "to itself": (OVER_TP, OVER_TP, 0),
    "from every copy": (EVERY, OVER_TP, 4 * N),  # reduce at an owner (3), then its replica (1)
    "a value, replicated": (Replicated([0, 1, 2, 3]), OVER_TP, 0),
    "a value, rows": (Chunk(0, [0, 1, 2, 3]), OVER_TP, N),  # the owner's replica lacks it
    "a value, rows over tp": (Named(MESH, ("tp",)), OVER_TP, 0),
}


@pytest.mark.parametrize("case", list(PLANS))
def test_plans_send_exactly_their_lower_bound(case):
    src, dst, sent = PLANS[case]
    p = fshard.plan(src.layout(SHAPE), dst.layout(SHAPE))
    assert p.min_elements_sent == sent
    assert p.elements_sent == sent
    assert int(p.traffic().sum()) == sent


def test_a_reduce_scatter_reads_each_summand_from_the_receivers_own_dp_row():
    p = fshard.plan(OVER_TP.layout(SHAPE), Chunk(0, [0, 1, 2, 3]).layout(SHAPE))
    quarter = N // 4
    assert p.traffic().tolist() == [[0, quarter, 0, 0], [quarter, 0, 0, 0], [0, 0, 0, quarter], [0, 0, quarter, 0]]


def test_no_whole_group_collective_runs_replicated_summands():
    """all_reduce over the 4 ranks would add each summand twice (once per dp replica)."""
    ranks = (0, 1, 2, 3)
    whole = Partial(Replicated(list(ranks))).layout(SHAPE)
    assert collective_kind(fshard.plan(whole, Replicated(list(ranks)).layout(SHAPE)), ranks) == "all_reduce"
    for dst in (Replicated(list(ranks)), Chunk(0, list(ranks))):
        assert collective_kind(fshard.plan(OVER_TP.layout(SHAPE), dst.layout(SHAPE)), ranks) is None


# -- operators -------------------------------------------------------------------------------


def test_linear_operators_count_each_summand_once():
    p, every = _summands(OVER_TP), _summands(EVERY)
    assert torch.equal(fshard.gather(2 * p), 6 * BASE)
    assert torch.equal(fshard.gather(p / 2), 1.5 * BASE)
    assert torch.equal(fshard.gather(-p), -3 * BASE)
    assert torch.equal(fshard.gather(p + p), 6 * BASE)
    assert torch.equal(fshard.gather(p - every), -3 * BASE)  # summands held two ways
    assert torch.equal(fshard.gather(p.sum(0)), 3 * BASE.sum(0))
    assert torch.equal(fshard.gather(p.sum()), 3 * BASE.sum())
    assert float(fshard.global_norm({"p": p})) == pytest.approx(float((3 * BASE).norm()), rel=1e-15)
    clipped, norm = fshard.clip_grad_norm([p], max_norm=1.0, eps=0.0)
    assert float(norm) == pytest.approx(float((3 * BASE).norm()), rel=1e-15)
    assert torch.allclose(fshard.gather(clipped[0]), 3 * BASE / (3 * BASE).norm(), rtol=1e-12, atol=1e-12)


def test_split_replicas_keeps_one_copy_of_each_summand():
    q = split_replicas(_summands(OVER_TP))
    assert q.layout == EVERY.layout(SHAPE)
    assert [float(s.data.sum()) for s in q.addressable_shards] == [float(BASE.sum()), 2 * float(BASE.sum()), 0, 0]


def test_map_local_linear_keeps_the_summands():
    y = fshard.map_local(lambda t: 2 * t, _summands(OVER_TP), linear=True)
    assert y.layout == OVER_TP.layout(SHAPE)
    assert torch.equal(fshard.gather(y), 6 * BASE)


# -- gradients -------------------------------------------------------------------------------

W = torch.randint(-9, 10, SHAPE, generator=torch.Generator().manual_seed(3)).double()  # exact sums


def test_the_gradient_of_a_reduction_reaches_every_copy():
    """Each copy (a summand, or a replica of one) gets the gradient of the sum, as a replica would."""
    layout = OVER_TP.layout(SHAPE)
    leaves = [((m.placement.rank % 2 + 1) * BASE).requires_grad_(True) for m in layout.shards]
    p = fshard.from_local_shards_and_layout([fshard.Shard(m, t) for m, t in zip(layout.shards, leaves)], layout)
    (fshard.gather(fshard.reshard(p, Chunk(0, [0, 1, 2, 3]))) * W).sum().backward()
    assert all(torch.equal(t.grad, W) for t in leaves)


@pytest.mark.parametrize("target", [Chunk(1, [0, 1, 2, 3]), Replicated([0, 1, 2, 3]), Single(1)])
def test_a_value_through_a_pending_sum_over_tp_has_the_dense_gradient(target):
    def loss(x: torch.Tensor) -> torch.Tensor:
        p = fshard.reshard(fshard.shard(x, Chunk(0, [0, 1, 2, 3])), OVER_TP)
        return (fshard.gather(fshard.reshard(p, target)) ** 2 * W).sum()

    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4), dtype=torch.float64, requires_grad=True)
    loss(x).backward()
    assert torch.allclose(x.grad, 2 * x.detach() * W, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(loss, (x.detach().clone().requires_grad_(True),))


# -- shard_map -------------------------------------------------------------------------------

MESH3 = Mesh((2, 2, 2))  # axes x, y, z


def test_matmul_reduce_scatter_of_a_sum_over_y_replicated_over_x():
    """JAX's shard_map test_matmul_reduce_scatter: a @ b blocks summed over y, reduce-scattered over (z, y)."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)
    matmul = fshard.shard_map(
        lambda ab, bb: ab @ bb,
        in_specs=(Named(MESH3, ("z", "y")), Named(MESH3, ("y", None))),
        out_specs=Partial(Named(MESH3, ("z", None)), over="y"),  # [B.z, F] {y unreduced}, replicated over x
    )
    c = matmul(a, b)
    assert c.layout.terms.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [tuple(s.data.shape) for s in c.addressable_shards] == [(4, 8)] * 8
    scattered = fshard.reshard(c, Named(MESH3, (("z", "y"), None)))
    assert [tuple(s.data.shape) for s in scattered.addressable_shards] == [(2, 8)] * 8
    assert torch.allclose(fshard.gather(scattered), a @ b, rtol=1e-12, atol=1e-12)
    p = fshard.plan(c.layout, scattered.layout)
    # Per element: 2 summands and 2 destination ranks (one per x), one of them a summand's: 2 + 2 - 1 - 1.
    assert p.elements_sent == p.min_elements_sent == 2 * 64


def test_a_row_parallel_linear_on_dp_tp_reduces_over_tp():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)
    linear = fshard.shard_map(
        lambda xb, wb: xb @ wb, in_specs=(Named(MESH, (None, "tp")), Named(MESH, ("tp", None))), out_specs=OVER_TP
    )
    y = linear(x, w)
    assert torch.allclose(fshard.gather(fshard.reshard(y, Replicated([0, 1, 2, 3]))), x @ w, rtol=1e-12, atol=1e-12)


def test_a_row_parallel_linear_has_the_dense_gradient():
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        linear = fshard.shard_map(
            lambda xb, wb: xb @ wb, in_specs=(Named(MESH, (None, "tp")), Named(MESH, ("tp", None))), out_specs=OVER_TP
        )
        return (fshard.gather(fshard.reshard(linear(x, w), Chunk(0, [0, 1, 2, 3]))) ** 2).sum()

    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    loss(x, w).backward()
    xd, wd = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    ((xd @ wd) ** 2).sum().backward()
    assert torch.allclose(x.grad, xd.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(w.grad, wd.grad, rtol=1e-12, atol=1e-12)


# -- checkpoints -----------------------------------------------------------------------------


def test_a_pending_sum_over_tp_is_not_saved(tmp_path):
    message = r"ShardedArray at \['p'\] has a pending sum .*Reshard it to a non-partial spec first"
    with pytest.raises(fshard.SpecError, match=message):
        fshard.save(tmp_path / "ck", {"p": _summands(OVER_TP)})
    assert not (tmp_path / "ck").exists()


# -- DTensor's placements (the conversions themselves run on 4 processes: tests/test_interop.py) ---


def test_dtensor_partial_placements_read_as_a_pending_op_over_their_axes():
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate, Shard

    from fshard._interop.pending import pending_of

    assert pending_of([Replicate(), DPartial()], MESH) == ("sum", ("tp",))
    assert pending_of([DPartial("max"), DPartial("max")], MESH) == ("max", ("dp", "tp"))
    assert pending_of([Shard(0), Replicate()], MESH) is None
    with pytest.raises(fshard.SpecError, match=re.escape("reduces by another op than the other partial dims")):
        pending_of([DPartial("sum"), DPartial("max")], MESH)  # (DTensor refuses to build one)
    with pytest.raises(fshard.SpecError, match=re.escape("[Replicate(), Shard(dim=0)])")):
        pending_of([DPartial("avg"), Shard(0)], MESH)


def test_torch_func_transforms_run_through_a_sum_over_tp():
    def f(x: torch.Tensor) -> torch.Tensor:
        p = fshard.reshard(fshard.shard(x, Chunk(0, [0, 1, 2, 3])), OVER_TP)
        return fshard.gather(fshard.reshard(p, Chunk(1, [0, 1, 2, 3]))) * 3

    g = torch.Generator().manual_seed(8)
    xs = torch.randn(5, *SHAPE, generator=g, dtype=torch.float64)
    assert torch.equal(torch.func.vmap(f)(xs), 3 * xs)  # the batch dim: a layout with_batch keeps the terms
    x, t = xs[0], xs[1]
    _, tangent = torch.func.jvp(f, (x,), (t,))
    assert torch.equal(tangent, 3 * t)
    assert torch.allclose(torch.func.grad(lambda x: f(x).pow(2).sum())(x), 18 * x, rtol=1e-12, atol=1e-12)
