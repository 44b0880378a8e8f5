"""The examples written with ``shard_map`` and ``Partial`` match their unsharded models.

``tp_mlp`` (a column- then row-parallel MLP, one SGD step) and ``transformer_block`` (a
pre-norm block, heads and MLP split over ``tp``, batch over ``dp``, AdamW steps) run
their ``check`` on the local backend with 1, 2 and 4 ranks and on the pool of 4 Gloo
processes; each result's ``ok`` and its losses are asserted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_examples import example  # the example scripts, imported as modules

import fshard

REL = 1e-9  # float64; the sharded sums run in another order


def assert_tp_mlp_matches(result: dict[str, Any], ranks: int) -> None:
    assert result["ranks"] == ranks
    assert result["bad_gradients"] == []
    assert result["loss"] == pytest.approx(result["reference"], rel=REL)
    assert result["next_loss"] == pytest.approx(result["next_reference"], rel=REL)
    assert result["ok"]


def assert_block_matches(result: dict[str, Any], mesh: tuple[int, int], summed: int) -> None:
    transformer_block = example("transformer_block")
    assert result["mesh"] == mesh
    assert len(result["losses"]) == transformer_block.STEPS
    assert result["losses"] == pytest.approx(result["references"], rel=REL)
    assert result["references"][-1] < result["references"][0]  # AdamW trains the block
    assert result["bad_gradients"] == []
    assert result["bad_params"] == []
    assert result["dp_summed"] == summed
    assert result["ok"]


# -- local backend ---------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_tp_mlp_matches_the_unsharded_model(ranks: int) -> None:
    assert_tp_mlp_matches(example("tp_mlp").check(range(ranks)), ranks)


def test_tp_mlp_row_parallel_output_is_a_pending_sum_reduced_to_batch_rows() -> None:
    tp_mlp = example("tp_mlp")
    params = tp_mlp.shard_model(tp_mlp.model(), range(4))
    x, _ = tp_mlp.batch(0)
    h = tp_mlp.column_parallel(x, params["0.weight"], params["0.bias"])
    assert h.layout == fshard.Chunk(1, range(4)).layout((6, 10))
    out = tp_mlp.row_parallel(h, params["2.weight"], params["2.bias"])
    assert out.layout == fshard.Chunk(0, range(4)).layout((6, 3))
    torch.testing.assert_close(fshard.gather(out), tp_mlp.model()(x), rtol=REL, atol=1e-12)


# 12 parameters; on the 2 x 2 mesh each of the 4 ranks holds one shard of each, a copy over dp.
@pytest.mark.parametrize(("ranks", "mesh", "summed"), [(1, (1, 1), 0), (2, (1, 2), 0), (4, (2, 2), 48)])
def test_transformer_block_matches_torch_nn_over_adamw_steps(ranks: int, mesh: tuple[int, int], summed: int) -> None:
    assert_block_matches(example("transformer_block").check(range(ranks)), mesh, summed)


def test_transformer_block_check_flags_a_gradient_not_summed_over_dp() -> None:
    tb = example("transformer_block")
    block, m = tb.model(), tb.mesh(range(4))
    params = tb.shard_model(block, range(4))
    x, y = tb.batch(0)
    rows = tb._dp_rows(m)
    parts = {r: tb.reference_grads(block, x, y, s) for r, s in rows.items()}

    def own_group_only(name: str, a: fshard.ShardedArray) -> fshard.ShardedArray:
        shards = [
            fshard.Shard(s.meta, tb._box(parts[s.meta.placement.rank][name], s.meta).clone())
            for s in a.addressable_shards
        ]
        return fshard.from_local_shards_and_layout(shards, a.layout)

    unsummed = {name: own_group_only(name, a) for name, a in params.items()}
    bad = tb.check_grads(unsummed, block, x, y, m)["bad_gradients"]
    assert len(bad) == 2 * 48  # each shard: not the whole gradient, and only its group's part
    assert "self_attn.in_proj_weight shard (0, 0, 0, 0) on rank 0 (only its dp group's part)" in bad

    grads = torch.func.grad(tb.loss_fn)(params, x, y, m)
    assert tb.check_grads(grads, block, x, y, m) == {"bad_gradients": [], "dp_summed": 48}


def test_transformer_block_main_reports_the_2x2_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    assert example("transformer_block").main(["--ranks", "4"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("4 ranks, mesh (2, 2): AdamW losses")
    assert line.endswith("48 gradient shards hold the sum over 2 dp groups: ok")


# -- over the Gloo pool: 4 worker processes ------------------------------------------------------


def _tp_mlp() -> dict[str, Any]:
    return example("tp_mlp").check(range(dist.get_world_size()))


def _transformer_block() -> dict[str, Any]:
    return example("transformer_block").check(range(dist.get_world_size()))


@pytest.mark.multiprocess
def test_tp_mlp_over_gloo(dist_pool) -> None:
    results = dist_pool.run(_tp_mlp)
    for r in results:
        assert_tp_mlp_matches(r, 4)
    assert len({r["loss"] for r in results}) == 1  # every rank computes the same loss


@pytest.mark.multiprocess
def test_transformer_block_over_gloo_on_the_2x2_mesh(dist_pool) -> None:
    results = dist_pool.run(_transformer_block)
    for r in results:
        assert_block_matches(r, (2, 2), 12)  # one shard per parameter on each rank
    assert len({tuple(r["losses"]) for r in results}) == 1
