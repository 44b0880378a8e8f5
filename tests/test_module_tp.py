"""Tensor parallelism through the module API: ``fshard.tensor_parallel`` rules and ``apply_module(..., rules=)``.

examples/gpt_modules_tp.py trains an unmodified ``torch.nn`` GPT TP+DP on a 2 x 2 mesh: 5 SGD
steps in float64 equal to the dense model, on the local backend and on the 4 Gloo processes
of the pool; the parameters saved by the 4-rank run resume on 2 ranks and keep matching the
dense model. The rules' layouts, the errors, the module left as it was, and FSDP over dp.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from test_examples import EXAMPLES, example

import fshard

TOL = 1e-12
R4 = [0, 1, 2, 3]


def _gpt() -> Any:
    return example("gpt_modules_tp")


def _mesh(ranks: list[int] = R4) -> fshard.Mesh:
    return fshard.Mesh((len(ranks) // 2, 2), ranks=ranks, axis_names=("dp", "tp"))


def _diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# -- the rules -------------------------------------------------------------------------------


def test_rules_split_column_parallel_by_output_and_row_parallel_by_input_over_tp():
    g = _gpt()
    params, buffers = fshard.shard_module(g.make_model(), fshard.tensor_parallel(_mesh(), g.PLAN))
    assert buffers == {}
    mesh = _mesh()
    assert params["blocks.0.q.weight"].layout == fshard.Named(mesh, ("tp", None)).layout((16, 16))
    assert params["blocks.0.fc.bias"].layout == fshard.Named(mesh, ("tp",)).layout((64,))
    assert params["blocks.1.out.weight"].layout == fshard.Named(mesh, (None, "tp")).layout((16, 64))
    assert params["blocks.1.out.bias"].layout.is_fully_replicated
    assert params["wte.weight"].layout.is_fully_replicated  # the head is tied to it: one array
    assert "head.weight" not in params
    assert [tuple(s.data.shape) for s in params["blocks.0.proj.weight"].addressable_shards] == [(16, 8)] * 4


def test_fsdp_also_splits_each_parameter_over_dp_where_stored():
    g = _gpt()
    rules = fshard.tensor_parallel(_mesh(), g.PLAN, fsdp=True)
    params, _ = fshard.shard_module(g.make_model(), rules)
    assert params["blocks.0.q.weight"].layout == fshard.Named(_mesh(), ("tp", "dp")).layout((16, 16))
    assert params["blocks.0.proj.weight"].layout == fshard.Named(_mesh(), ("dp", "tp")).layout((16, 16))
    assert params["ln.weight"].layout == fshard.Named(_mesh(), ("dp",)).layout((16,))
    assert rules.body_spec("blocks.0.q.weight") == fshard.Named(_mesh(), ("tp",))


def test_rows_and_summed_specs():
    rules = fshard.tensor_parallel(_mesh(), {})
    assert rules.rows == fshard.Named(_mesh(), ("dp",))
    assert rules.summed == fshard.Partial(fshard.Named(_mesh(), ()), over=("dp",))
    pure = fshard.tensor_parallel(fshard.Mesh((2,), axis_names=("tp",)), {}, dp=None)
    assert pure.rows == pure.summed == fshard.Named(pure.mesh, ())


# -- training equal to the dense model ---------------------------------------------------------


def test_five_steps_on_a_2x2_mesh_match_the_dense_model_locally():
    result = _gpt().check(R4)
    assert result["bad"] == []
    assert _diff(result["losses"], result["dense"]) <= TOL
    assert result["ok"]


def test_the_script_checks_1_and_2_ranks(capsys: pytest.CaptureFixture[str]):
    assert _gpt().main(["--ranks", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp=1, tp=1" in out
    assert "dp=1, tp=2" in out
    assert "MISMATCH" not in out


def test_fsdp_over_dp_trains_like_the_dense_model():
    g = _gpt()
    model = g.make_model()
    rules = fshard.tensor_parallel(_mesh(), g.PLAN, fsdp=True)
    params, buffers = fshard.shard_module(model, rules)
    losses = g.train(model, rules, params, buffers, range(3))
    want, weights = g.dense(3)
    assert _diff(losses, want) <= TOL
    for name, a in params.items():
        assert torch.allclose(fshard.gather(a), weights[name], rtol=0, atol=TOL), name


def test_the_module_is_left_as_it_was():
    g = _gpt()
    model = g.make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rules = fshard.tensor_parallel(_mesh(), g.PLAN)
    params, buffers = fshard.shard_module(model, rules)
    g.train(model, rules, params, buffers, range(1))
    assert type(model.blocks[0].proj) is torch.nn.Linear
    assert "_tp_axis" not in vars(model.blocks[0].proj)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_default_result_spec_is_the_rows():
    g = _gpt()
    model = g.make_model()
    rules = fshard.tensor_parallel(_mesh(), g.PLAN)
    params, buffers = fshard.shard_module(model, rules)
    tokens, _ = g.batch(0)
    with torch.no_grad():
        logits, _ = fshard.apply_module(model, params, buffers, fshard.shard(tokens, rules.rows), rules=rules)
        assert logits.layout == rules.rows.layout((4, 8, 32))
        assert torch.allclose(fshard.gather(logits), model(tokens), rtol=0, atol=TOL)


def _resume_on_2_ranks(path: Path) -> tuple[list[float], dict[str, fshard.ShardedArray]]:
    """Loads the 4-rank run's parameters into a 1 x 2 TP layout (local backend) and trains 3 more steps."""
    g = _gpt()
    model = g.make_model()
    rules = fshard.tensor_parallel(_mesh([0, 1]), g.PLAN)
    like, buffers = fshard.shard_module(model, rules)
    params = fshard.load(path, like=like)
    assert params["blocks.0.q.weight"].layout == like["blocks.0.q.weight"].layout
    for t in (t for a in params.values() for t in a.addressable_data):
        t.requires_grad_()
    return g.train(model, rules, params, buffers, range(g.STEPS, g.STEPS + 3)), params


def _check_resumed(path: Path) -> None:
    g = _gpt()
    losses, params = _resume_on_2_ranks(path)
    want, weights = g.dense(g.STEPS + 3)
    assert _diff(losses, want[g.STEPS :]) <= TOL
    for name, a in params.items():
        assert torch.allclose(fshard.gather(a), weights[name], rtol=0, atol=TOL), name


def test_parameters_saved_on_4_ranks_resume_on_2_locally(tmp_path: Path):
    _, params = _gpt().program(R4)
    fshard.save(tmp_path / "ckpt", params)
    _check_resumed(tmp_path / "ckpt")


def _train_and_save_on_gloo(path: str) -> list[float]:
    losses, params = _gpt().program(range(dist.get_world_size()))
    fshard.save(path, params)
    return losses


@pytest.mark.multiprocess
def test_five_steps_on_4_gloo_processes_match_the_dense_model_and_resume_on_2_ranks(dist_pool, tmp_path: Path):
    path = tmp_path / "ckpt"
    results = dist_pool.run(_train_and_save_on_gloo, str(path), timeout=240)
    want, _ = _gpt().dense()
    for rank, losses in enumerate(results):
        assert _diff(losses, want) <= TOL, f"rank {rank}"
    assert (path / "index.json").is_file()
    _check_resumed(path)


class _Checkpointed(torch.nn.Module):
    """examples/gpt_modules_tp.py's GPT with every block under torch.utils.checkpoint (use_reentrant=False)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = _gpt().make_model()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        x = gpt.wte(tokens) + gpt.wpe(torch.arange(tokens.shape[1]))
        for block in gpt.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return gpt.head(gpt.ln(x))


def _checkpointed_steps(steps: int) -> tuple[list[float], list[float], float]:
    """Losses of TP+DP steps of the checkpointed GPT, the dense model's, and the largest parameter difference."""
    g = _gpt()
    model = _Checkpointed()
    ranks = list(range(dist.get_world_size())) if dist.is_initialized() else R4
    rules = fshard.tensor_parallel(_mesh(ranks), g.PLAN)
    params, buffers = fshard.shard_module(model, rules)
    losses = g.train(model, rules, params, buffers, range(steps))
    want, weights = g.dense(steps)
    with torch.no_grad():
        worst = max(float((fshard.gather(a) - weights[n.removeprefix("gpt.")]).abs().max()) for n, a in params.items())
    return losses, want, worst


def test_checkpointed_blocks_train_like_the_dense_model():
    # The recomputation in the backward runs outside the body: each row-parallel Linear
    # gives back the sum its forward computed instead of meeting the other placements again.
    losses, want, worst = _checkpointed_steps(2)
    assert _diff(losses, want) <= TOL
    assert worst <= TOL


@pytest.mark.multiprocess
def test_checkpointed_blocks_train_like_the_dense_model_on_4_gloo_processes(dist_pool):
    for rank, (losses, want, worst) in enumerate(dist_pool.run(_checkpointed_steps, 2, timeout=240)):
        assert _diff(losses, want) <= TOL, f"rank {rank}"
        assert worst <= TOL, f"rank {rank}"


class _TwiceInOneCheckpoint(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def twice(h: torch.Tensor) -> torch.Tensor:
            return self.out(self.fc(self.out(self.fc(h))).tanh())

        return torch.utils.checkpoint.checkpoint(twice, x, use_reentrant=False)


def test_checkpointing_a_row_parallel_linear_called_twice_is_refused():
    model = _TwiceInOneCheckpoint().double()
    rules = fshard.tensor_parallel(_mesh(), {"fc": "colwise", "out": "rowwise"})
    params, buffers = fshard.shard_module(model, rules)
    x = fshard.shard(torch.randn(4, 4, dtype=torch.float64), rules.rows)
    total, _ = fshard.apply_module(
        model, params, buffers, x, method=lambda m, xb: m(xb).sum()[None], out_specs=rules.summed, rules=rules
    )
    with pytest.raises(fshard.SpecError, match=re.escape("but its clone ran 2 times in the forward")):
        fshard.gather(total)[0].backward()


# -- the program stays short --------------------------------------------------------------------


def _code_lines(path: Path, names: set[str]) -> int:
    """Lines of code of the module-level functions and assignments ``names``: no blank, comment or docstring."""
    source = path.read_text()
    lines, tree = source.splitlines(), ast.parse(source)
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) is not None:
            docs.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    nodes = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in names)
        or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets))
    ]
    assert len(nodes) == len(names)
    return sum(
        1
        for node in nodes
        for n in range(node.lineno, node.end_lineno + 1)
        if n not in docs and lines[n - 1].strip() and not lines[n - 1].strip().startswith("#")
    )


def test_the_tp_dp_program_is_26_lines_of_code():
    # The plan, the setup and the training loop: the model and the check are not the program.
    assert _code_lines(EXAMPLES / "gpt_modules_tp.py", {"PLAN", "program", "train"}) == 26


# -- errors -------------------------------------------------------------------------------------


class _FixedHeads(torch.nn.Module):
    """Attention that reshapes to a fixed head count: it cannot run on a placement's share of the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 2).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(b, t, -1)
        return self.proj(a)


def test_a_fixed_head_count_is_refused_with_the_fix():
    model = _FixedHeads().double()
    rules = fshard.tensor_parallel(_mesh(), {"q": "colwise", "proj": "rowwise"})
    params, buffers = fshard.shard_module(model, rules)
    x = fshard.shard(torch.randn(2, 3, 8, dtype=torch.float64), rules.rows)
    with pytest.raises(fshard.SpecError, match=re.escape("reshape with -1 heads (x.view(b, t, -1, head_dim))")):
        fshard.apply_module(model, params, buffers, x, rules=rules)


def _bad_rules() -> list[Any]:
    mesh = _mesh()
    return [
        pytest.param(
            lambda: fshard.tensor_parallel(mesh, {"*.q": "columnwise"}),
            "plan entry '*.q': 'columnwise': keys are fnmatch patterns (str) and styles one of ('colwise', 'rowwise')",
            id="unknown-style",
        ),
        pytest.param(
            lambda: fshard.tensor_parallel(mesh, {}, tp="model"),
            "tp='model' is not an axis of the mesh (its axes are ('dp', 'tp')): name one.",
            id="missing-axis",
        ),
        pytest.param(
            lambda: fshard.tensor_parallel(mesh, {}, tp="dp", dp="dp"),
            "tp and dp are both 'dp': give two different mesh axes.",
            id="same-axis",
        ),
        pytest.param(
            lambda: fshard.tensor_parallel(fshard.Mesh((2,), axis_names=("tp",)), {}, dp=None, fsdp=True),
            "fsdp=True shards parameters over dp: give dp= a mesh axis.",
            id="fsdp-without-dp",
        ),
        pytest.param(
            lambda: fshard.shard_module(_gpt().make_model(), fshard.tensor_parallel(mesh, {"*.query": "colwise"})),
            "pattern '*.query' names no submodule",
            id="pattern-names-nothing",
        ),
        pytest.param(
            lambda: fshard.shard_module(_gpt().make_model(), fshard.tensor_parallel(mesh, {"*.ln1": "colwise"})),
            "makes submodule 'blocks.0.ln1' colwise, but it is a LayerNorm: only torch.nn.Linear modules",
            id="not-a-linear",
        ),
        pytest.param(
            lambda: fshard.shard_module(
                torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2)),
                fshard.tensor_parallel(mesh, {"0.out_proj": "rowwise"}),
            ),
            "makes submodule '0.out_proj' rowwise, but it is a MultiheadAttention's out_proj, whose weight the "
            "attention reads itself",
            id="attention-out-proj",
        ),
    ]


@pytest.mark.parametrize(("make", "message"), _bad_rules())
def test_bad_rules_are_refused(make: Any, message: str):
    with pytest.raises(fshard.SpecError, match=re.escape(message)):
        make()


def test_inputs_off_the_mesh_are_refused():
    g = _gpt()
    model = g.make_model()
    rules = fshard.tensor_parallel(_mesh(), g.PLAN)
    params, buffers = fshard.shard_module(model, rules)
    tokens = fshard.shard(g.batch(0)[0], fshard.Chunk(0, [0, 1]))
    with pytest.raises(
        fshard.SpecError, match=re.escape("shard the inputs over the mesh, e.g. fshard.shard(x, rules.rows)")
    ):
        fshard.apply_module(model, params, buffers, tokens, rules=rules)


class _ColumnHead(torch.nn.Module):
    """A hidden layer and an output Linear: planned "colwise", the head's output is each placement's columns."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.body(h)))


def _column_head_outputs() -> list[str]:
    """A plan whose colwise output no rowwise Linear sums, per way of reading it: what each first call raised.

    Each plan is called twice; a right plan's first call is compared too, its second is not.
    """
    torch.manual_seed(0)
    model = _ColumnHead()
    h = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out: list[str] = []
    for plan, method in (
        ({"out": "colwise"}, None),
        ({"out": "colwise"}, lambda m, hb: m(hb).sum(-1)),
        ({"body": "colwise", "out": "rowwise"}, None),
    ):
        rules = fshard.tensor_parallel(_mesh(), plan)
        params, buffers = fshard.shard_module(model, rules)
        for _ in range(2):  # a call that raised is compared again at the next
            try:
                got, _ = fshard.apply_module(
                    model, params, buffers, fshard.shard(h, rules.rows), rules=rules, method=method
                )
            except fshard.ReplicaMismatchError as e:
                out.append(str(e).split(". ")[0])  # its first sentence: the digests may differ per backend
                continue
            want = model(h) if method is None else model(h).sum(-1)
            out.append(f"ok {torch.allclose(fshard.gather(got), want, atol=1e-6)}")
    return out


def test_a_colwise_output_no_rowwise_linear_sums_is_refused_at_the_first_call_on_both_backends(dist_pool):
    local = _column_head_outputs()
    refused = (
        "apply_module() under tensor parallelism: its result differs between the tp placements, where the rules make "
        "it whole along tp"
    )
    assert local == [refused, refused, refused, refused, "ok True", "ok True"]
    assert dist_pool.run(_column_head_outputs, timeout=120) == [local] * 4


class _SharedBlock(torch.nn.Module):
    """One block reused at every depth (ALBERT's pattern): its submodules have two names each."""

    def __init__(self) -> None:
        super().__init__()
        block = torch.nn.ModuleDict({"up": torch.nn.Linear(8, 16), "down": torch.nn.Linear(16, 8)})
        self.layers = torch.nn.ModuleList([block, block])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            h = h + b["down"](torch.relu(b["up"](h)))
        return h


@pytest.mark.parametrize(
    "plan",
    [
        {"layers.*.up": "colwise", "layers.*.down": "rowwise"},
        {"layers.0.up": "colwise", "layers.0.down": "rowwise", "layers.1.up": "colwise", "layers.1.down": "rowwise"},
    ],
)
def test_a_block_reused_under_several_names_is_planned_by_any_of_them(plan: dict[str, str]):
    torch.manual_seed(0)
    model = _SharedBlock().double()
    rules = fshard.tensor_parallel(_mesh(), plan)
    params, buffers = fshard.shard_module(model, rules)
    x = torch.randn(4, 8, dtype=torch.float64)
    out, _ = fshard.apply_module(model, params, buffers, fshard.shard(x, rules.rows), rules=rules)
    fshard.gather(out).square().sum().backward()
    model(x).square().sum().backward()
    torch.testing.assert_close(fshard.gather(out), model(x))
    assert sorted(params) == ["layers.0.down.bias", "layers.0.down.weight", "layers.0.up.bias", "layers.0.up.weight"]
    for name, array in params.items():
        for s in array.addressable_shards:
            box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes, strict=True))
            torch.testing.assert_close(s.data.grad, model.get_parameter(name).grad[box])
    only_first = {"layers.0.up": "colwise", "layers.0.down": "rowwise"}  # its other name is left whole
    with pytest.raises(fshard.SpecError, match=r"'layers\.1\.up\.weight' .* tied to 'layers\.0\.up\.weight'"):
        fshard.shard_module(model, fshard.tensor_parallel(_mesh(), only_first))
    # Planned by its later name only, the parameters (laid out by the first) would stay whole where the psum
    # of a row-parallel Linear sums them over tp: refused, also where the parameters were sharded otherwise.
    only_second = fshard.tensor_parallel(_mesh(), {"layers.1.up": "colwise", "layers.1.down": "rowwise"})
    whole, _ = fshard.shard_module(model, fshard.fully_sharded(R4))
    with pytest.raises(fshard.SpecError, match=re.escape("makes 'layers.1.up' colwise, but it is the submodule")):
        fshard.apply_module(model, whole, buffers, fshard.shard(x, only_second.rows), rules=only_second)
