"""psum and pmean inside shard_map bodies on the local backend.

Values and gradients against dense float64 references (tests/psum_programs.py), on 1-D
and (dp, tp) meshes with uneven blocks, over each axis and both; determinism; the
errors (outside a body, an unknown axis, a body that raises, bodies that reduce
differently); the caller's modes in the threads that run the bodies.
"""

from __future__ import annotations

import re
import threading

import psum_programs as programs
import pytest
import torch

import fshard

MESH = fshard.Mesh((2, 2), axis_names=("dp", "tp"))


def _max_error(a: list, b: list) -> float:
    return float((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max())


@pytest.mark.parametrize("name", sorted(programs.CASES))
def test_values_and_gradients_match_the_dense_program(name):
    value, grad = programs.sharded(name)
    want_value, want_grad = programs.dense(name)
    assert _max_error(value, want_value) <= 1e-12
    assert _max_error(grad, want_grad) <= 1e-12


@pytest.mark.parametrize("seed", range(16))
def test_random_programs_match_the_dense_program(seed):
    case, shape = programs.random_case(seed)
    value, grad = programs.sharded("random", case=case, shape=shape)
    want_value, want_grad = programs.dense("random", case=case, shape=shape)
    assert _max_error(value, want_value) <= 1e-12, case
    assert _max_error(grad, want_grad) <= 1e-12, case


def test_two_runs_are_bit_identical():
    first = programs.sharded("2d-over-both", dtype=torch.float32)
    second = programs.sharded("2d-over-both", dtype=torch.float32)
    assert first == second


def test_sums_run_in_placement_order():
    # float32 sums of 1, 1e8, -1e8 in placement order (1 + 1e8 rounds to 1e8): 0, not 1.
    ranks = [0, 1, 2]
    f = fshard.shard_map(
        lambda b: fshard.psum(b, "x"), in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks)
    )
    got = fshard.gather(f(torch.tensor([1.0, 1e8, -1e8])))
    assert got.tolist() == [0.0, 0.0, 0.0]


def test_psum_over_tp_gives_the_blocks_sum_on_each_placement():
    f = fshard.shard_map(
        lambda b: fshard.psum(b, "tp"),
        in_specs=fshard.Named(MESH, ("dp", "tp")),
        out_specs=fshard.Named(MESH, ("dp", None)),
        check_vma=False,
    )
    assert fshard.gather(f(torch.arange(8.0).reshape(2, 4))).tolist() == [[2.0, 4.0], [10.0, 12.0]]


def test_pmean_divides_by_the_group_size():
    f = fshard.shard_map(
        lambda b: fshard.pmean(b, ("dp", "tp")),
        in_specs=fshard.Named(MESH, ("dp", "tp")),
        out_specs=fshard.Named(MESH, ("dp", "tp")),
    )
    assert fshard.gather(f(torch.arange(4.0).reshape(2, 2))).tolist() == [[1.5, 1.5], [1.5, 1.5]]


def test_a_result_claimed_replicated_after_psum_needs_check_vma_false():
    f = fshard.shard_map(
        lambda b: fshard.psum(b, "tp"),
        in_specs=fshard.Named(MESH, ("dp", "tp")),
        out_specs=fshard.Named(MESH, ("dp", None)),
    )
    with pytest.raises(fshard.SpecError, match="replicas along mesh axis 'tp'"):
        f(torch.arange(8.0).reshape(2, 4))


def test_bodies_that_do_not_reduce_run_on_the_calling_thread():
    seen = []

    def body(b):
        seen.append(threading.current_thread() is threading.main_thread())
        return b + 1

    ranks = [0, 1, 2]
    fshard.shard_map(body, in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks))(torch.zeros(3))
    assert seen == [True, True, True]


def test_bodies_that_reduce_run_under_the_callers_grad_mode():
    seen = []

    def body(b):
        seen.append(torch.is_grad_enabled())
        return fshard.psum(b, "x")

    ranks = [0, 1]
    f = fshard.shard_map(body, in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks))
    x = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        y = f(x)
        f(x)  # the second call starts threads at once
    assert not y.requires_grad
    assert seen == [False] * len(seen)
    assert len(seen) == 5  # a first sequential try, then two placements twice


def test_in_place_writes_into_input_blocks_are_refused_in_the_threads():
    def body(b):
        s = fshard.psum(b.sum(), "x")
        b.mul_(s)
        return b

    ranks = [0, 1]
    f = fshard.shard_map(body, in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks))
    x = torch.ones(4)
    with pytest.raises(fshard.SpecError, match=re.escape("fn called aten::mul_.Tensor")):
        f(x)
    assert x.tolist() == [1.0] * 4


def test_psum_outside_a_body_is_refused():
    with pytest.raises(fshard.SpecError, match=re.escape("psum() was called outside a shard_map body")):
        fshard.psum(torch.ones(2), "x")


@pytest.mark.parametrize(
    ("axis", "mesh_axes"),
    [("y", "('dp', 'tp')"), (("tp", "tp"), "('dp', 'tp')"), ((), "('dp', 'tp')")],
    ids=["unknown", "repeated", "empty"],
)
def test_an_axis_the_mesh_does_not_have_is_refused(axis, mesh_axes):
    f = fshard.shard_map(
        lambda b: fshard.psum(b, axis),
        in_specs=fshard.Named(MESH, ("dp", "tp")),
        out_specs=fshard.Named(MESH, ("dp", "tp")),
    )
    with pytest.raises(
        fshard.SpecError, match=re.escape(f"psum() axis {axis!r}: the body's mesh has axes {mesh_axes}")
    ):
        f(torch.ones(2, 2))


def test_a_body_without_named_specs_has_the_one_axis_x():
    ranks = [0, 1]
    f = fshard.shard_map(
        lambda b: fshard.psum(b, "tp"), in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks)
    )
    with pytest.raises(fshard.SpecError, match="a body without Named in_specs has the one axis 'x'"):
        f(torch.ones(2))


def test_an_error_in_one_body_surfaces_and_stops_the_others():
    def body(b):
        s = fshard.psum(b, "x")
        if b.item() == 2.0:
            raise ValueError("bad block on placement 2")
        return fshard.psum(s, "x")

    ranks = [0, 1, 2, 3]
    f = fshard.shard_map(body, in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks))
    with pytest.raises(ValueError, match="bad block on placement 2"):
        f(torch.arange(4.0))
    assert not [t for t in threading.enumerate() if t.name.startswith("fshard-body-")]  # every body's thread ended


def test_bodies_that_reduce_a_different_number_of_times_are_refused():
    def body(b):
        s = fshard.psum(b, "x")
        return fshard.psum(s, "x") if b.item() == 0.0 else s

    ranks = [0, 1]
    f = fshard.shard_map(body, in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks))
    with pytest.raises(fshard.CollectiveMismatchError, match="returned after 1 psum"):
        f(torch.arange(2.0))


def test_placements_summed_together_with_different_shapes_are_refused():
    ranks = [0, 1]
    f = fshard.shard_map(
        lambda b: fshard.psum(b, "x"), in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks)
    )
    with pytest.raises(fshard.CollectiveMismatchError, match=re.escape("rank:0/cpu ((2,) torch.float32)")):
        f(torch.arange(3.0))


def test_psum_under_torch_func_is_refused():
    ranks = [0, 1]
    f = fshard.shard_map(
        lambda b: fshard.psum(b, "x").sum()[None], in_specs=fshard.Chunk(0, ranks),
        out_specs=fshard.Partial(fshard.Replicated(ranks)),
    )  # fmt: skip
    with pytest.raises(fshard.SpecError, match=re.escape("cannot run under a torch.func transform")):
        torch.func.grad(lambda x: fshard.gather(f(x)).sum())(torch.ones(2))


def _reduces_if(b: torch.Tensor, reduce: bool) -> torch.Tensor:
    return fshard.psum(b, "x") if reduce else b * 2


def test_a_body_whose_code_reduced_before_runs_under_torch_func_where_this_call_does_not_reduce():
    """Only a call that reduces is refused under a transform, as across processes; the code's history is not."""
    ranks = [0, 1, 2, 3]
    spec = (fshard.Chunk(0, ranks), None)
    x = torch.arange(8.0)
    summed = fshard.gather(fshard.shard_map(_reduces_if, spec, fshard.Chunk(0, ranks))(x, True))
    assert summed.tolist() == [12.0, 16.0] * 4
    plain = fshard.shard_map(_reduces_if, spec, fshard.Chunk(0, ranks))  # a new shard_map of the same code
    got = torch.func.grad(lambda t: fshard.gather(plain(t, False)).pow(2).sum())(x)
    torch.testing.assert_close(got, 8 * x)
    with pytest.raises(fshard.SpecError, match=re.escape("cannot run under a torch.func transform")):
        torch.func.grad(lambda t: fshard.gather(plain(t, True)).pow(2).sum())(x)


def test_a_closed_over_weight_gets_the_sum_of_its_uses():
    assert _max_error(programs.closed_over(), programs.closed_over(sharded_run=False)) <= 1e-12


def test_a_checkpoint_inside_a_body_that_reduces_is_refused_with_the_whole_call_as_the_way():
    """The recomputation runs in the backward, where no body runs; a checkpoint of the whole shard_map works."""
    import torch.utils.checkpoint as cp

    mesh = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
    rows, whole = fshard.Named(mesh, ("dp", None)), fshard.Named(mesh, (None, None))

    def block(xb: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
        return torch.tanh(xb + fshard.psum(xb @ wb, "tp"))

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, generator=g), torch.randn(3, 3, generator=g)

    def grads(f, checkpointed: bool) -> list[torch.Tensor]:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = cp.checkpoint(f, xs, ws, use_reentrant=False) if checkpointed else f(xs, ws)
        fshard.gather(y).sum().backward()
        return [xs.grad, ws.grad]

    inside = fshard.shard_map(
        lambda xb, wb: cp.checkpoint(block, xb, wb, use_reentrant=False), (rows, whole), rows, check_vma=False
    )
    with pytest.raises(fshard.SpecError, match="Checkpoint the whole shard_map call"):
        grads(inside, checkpointed=False)
    plain = fshard.shard_map(block, (rows, whole), rows, check_vma=False)
    for got, want in zip(grads(plain, checkpointed=True), grads(plain, checkpointed=False)):
        torch.testing.assert_close(got, want)


def test_a_psums_results_are_freed_once_the_call_and_its_backward_are_done():
    """Its autograd node held the body that held its outputs (the rendezvous's last sums), a cycle through C++
    that Python's collector cannot see: every step's sums stayed alive."""
    import gc
    import weakref

    ranks = [0, 1, 2, 3]
    f = fshard.shard_map(lambda b: fshard.psum(b * 2, "x"), fshard.Chunk(0, ranks), fshard.Chunk(0, ranks))
    x = torch.randn(4, 100, requires_grad=True)
    out = f(x)
    refs = [weakref.ref(t) for t in out.addressable_data]
    fshard.gather(out).sum().backward()
    del out
    gc.collect()
    assert [r() for r in refs] == [None] * 4


def _summed_with_unlike_neighbours(check_vma=True):
    """Ranks 0 and 1 get one box of ``x`` (replicas), ranks 2 and 3 two others; the body sums over "a", which
    adds rank 2's block to rank 0's and rank 3's to rank 1's: the result's copies on ranks 0 and 1 differ."""
    mesh = fshard.Mesh((2, 2), axis_names=("a", "b"))
    boxes = fshard.Layout((6, 3), [((0, 0), (2, 3), 0), ((0, 0), (2, 3), 1), ((2, 0), (2, 3), 2), ((4, 0), (2, 3), 3)])
    return fshard.shard_map(
        lambda m, b: fshard.psum(b, "a") + 0 * m.sum(),
        in_specs=(fshard.Named(mesh, (None,)), boxes),
        out_specs=boxes,
        check_vma=check_vma,
    )


def test_a_claim_of_replicas_whose_psum_groups_hold_unlike_blocks_is_refused():
    """The copies' own blocks are alike, but psum adds blocks of other placements to them: those count too."""
    x = torch.arange(18.0).reshape(6, 3)
    msg = "argument 1 gives the placements that fn's psum over ('a',) sums with them different blocks"
    with pytest.raises(fshard.SpecError, match=re.escape(msg)):
        _summed_with_unlike_neighbours()(torch.zeros(1), x)
    y = _summed_with_unlike_neighbours(check_vma=False)(torch.zeros(1), x)  # trusted: the copies do disagree
    assert [s.data[0, 0].item() for s in y.addressable_shards[:2]] == [6.0, 12.0]


def test_copies_along_an_axis_that_psum_does_not_sum_over_are_accepted():
    """Split along "dp", replicated along "tp"; a sum over "dp" keeps the copies along "tp" alike, group by group."""
    f = fshard.shard_map(
        lambda b: fshard.psum(b, "dp") * b,
        in_specs=fshard.Named(MESH, ("dp", None)),
        out_specs=fshard.Named(MESH, ("dp", None)),
    )
    x = torch.arange(8.0).reshape(2, 4)
    assert torch.equal(fshard.gather(f(x)), x.sum(0) * x)


def test_a_second_psum_over_another_axis_does_not_hide_the_first():
    """The axes of every psum pooled into one set made one group of the whole mesh: the copies on ranks 0 and 1
    (6 and 12) were accepted once the body also summed an unrelated value over "b"."""
    mesh = fshard.Mesh((2, 2), axis_names=("a", "b"))
    boxes = fshard.Layout((6, 3), [((0, 0), (2, 3), 0), ((0, 0), (2, 3), 1), ((2, 0), (2, 3), 2), ((4, 0), (2, 3), 3)])
    f = fshard.shard_map(
        lambda m, b: fshard.psum(b, "a") + 0 * m.sum() + 0 * fshard.psum(m, "b"),
        in_specs=(fshard.Named(mesh, (None,)), boxes),
        out_specs=boxes,
    )
    with pytest.raises(fshard.SpecError, match=re.escape("fn's psum over ('a',) and over ('b',) sums with them")):
        f(torch.zeros(1), torch.arange(18.0).reshape(6, 3))


def test_groups_of_two_are_alike_in_either_order():
    """Mesh ranks [[0, 1], [3, 2]]: in the placements' order (0, 1, 2, 3, from the first argument), which psum
    adds in, rank 3's group is (2, 3), whose blocks are rank 0's group's swapped; a + b and b + a are one value."""
    mesh = fshard.Mesh((2, 2), axis_names=("a", "b"), ranks=[[0, 1], [3, 2]])
    f = fshard.shard_map(
        lambda s, t: fshard.psum(t, "b") * t + 0 * s.sum(),
        in_specs=(fshard.Replicated([0, 1, 2, 3]), fshard.Named(mesh, (None, "b"))),
        out_specs=fshard.Named(mesh, (None, "b")),
    )
    x = torch.arange(8.0).reshape(2, 4)
    left, right = x[:, :2], x[:, 2:]
    assert torch.equal(fshard.gather(f(torch.zeros(1), x)), (left + right).repeat(1, 2) * x)


def test_groups_of_three_added_in_another_order_are_not_taken_for_copies():
    """Ranks [[0, 1, 2], [5, 4, 3]]: each row's sum over "b" adds the same three blocks, in placement order, so
    1 + 1e16 - 1e16 on one row and 1 - 1e16 + 1e16 on the other (0.0 and 1.0): refused as copies along "a"."""
    mesh = fshard.Mesh((2, 3), axis_names=("a", "b"), ranks=[[0, 1, 2], [5, 4, 3]])
    specs = {
        "in_specs": (fshard.Replicated(list(range(6))), fshard.Named(mesh, (None, "b"))),
        "out_specs": fshard.Named(mesh, (None, "b")),
    }
    x = torch.tensor([[1.0, 1e16, -1e16]])

    def body(s, t):
        return fshard.psum(t, "b") + 0 * s.sum()

    with pytest.raises(fshard.SpecError, match=re.escape("(or alike ones, added in another order)")):
        fshard.shard_map(body, **specs)(torch.zeros(1), x)
    y = fshard.shard_map(body, **specs, check_vma=False)(torch.zeros(1), x)  # trusted: the copies do disagree
    assert sorted({s.data.item() for s in y.addressable_shards}) == [0.0, 1.0]
