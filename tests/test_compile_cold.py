"""``torch.compile`` of a whole training step before any eager call: nothing cached, TorchDynamo cold.

Each local test runs its program in a fresh interpreter (``python this_file.py <program>``), so no
layout, plan or compiled frame exists when the step is first compiled. The step shards, reshards,
gathers (a tree), runs a ``shard_map`` forward, the backward and an AdamW step, and a module helper
loads the result back into a module. The compiled run must give the eager run's losses (float64),
every graph TorchDynamo builds must come from the test's own code or torch (never fshard's), and the
``shard_map`` body must be one of them. A step through the module API (``shard_module``,
``apply_module``) compiles from cold too, its module forward and loss compiled where ``apply_module``
runs them. On 4 Gloo processes the pool's workers are warm: they clear fshard's caches and reset
TorchDynamo first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import optree
import pytest
import torch

import fshard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSHARD_DIR = os.path.dirname(os.path.abspath(fshard.__file__))
BACKENDS_DIR = os.path.dirname(os.path.abspath(fshard.backends.__file__))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train(ranks: list[int], compiler: Any, steps: int = 3) -> dict[str, Any]:
    """Losses of ``steps`` AdamW steps (compiled with ``compiler`` unless None) and the trained model's outputs.

    Runs in float64 throughout: AdamW keeps ``step`` in the default dtype, and its compiled form computes
    the bias correction in that dtype where the eager one uses a Python float.
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _train64(ranks, compiler, steps)
    finally:
        torch.set_default_dtype(old)


def _train64(ranks: list[int], compiler: Any, steps: int) -> dict[str, Any]:
    model = _model()
    params = fshard.shard_params(model, lambda name, t: fshard.Chunk(0, ranks))
    leaves = [t.requires_grad_() for t in optree.tree_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=1e-2)
    names = list(params)
    rows, cols, everywhere = fshard.Chunk(0, ranks), fshard.Chunk(1, ranks), fshard.Replicated(ranks)
    x = torch.randn(32, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def block_loss(xb: torch.Tensor, yb: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, dict(zip(names, ws)), (xb,))
        return torch.nn.functional.mse_loss(out, yb, reduction="sum")[None]

    loss_of = fshard.shard_map(
        block_loss, in_specs=(rows, rows, *[everywhere] * len(names)), out_specs=fshard.Partial(everywhere)
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        batch = fshard.reshard(fshard.shard(x, cols), rows)  # a movement inside the step
        targets = fshard.shard(y, rows)
        full = fshard.gather(params)  # a tree gathered with gradients
        decay = 0 * 1e-3 * (full["0.weight"].pow(2).sum() + full["2.weight"].pow(2).sum())
        loss = fshard.gather(loss_of(batch, targets, *params.values())) / y.numel() + decay
        loss.backward()
        opt.step()
        return loss.detach()

    trained = _model()

    def evaluate(x: torch.Tensor) -> torch.Tensor:
        fshard.load_state_dict(trained, params)
        return trained(x)

    if compiler is not None:
        step, evaluate = torch.compile(step, backend=compiler), torch.compile(evaluate, backend=compiler)
    losses = [step(x, y).item() for _ in range(steps)]
    return {"losses": losses, "out": evaluate(x).detach().flatten().tolist()}


def _graphs_recorded(inner: str) -> tuple[Any, list[tuple[str, list[str]]]]:
    """A TorchDynamo backend that hands each graph to ``inner``, and the (file, ops) of each graph it got."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    seen: list[tuple[str, list[str]]] = []
    compile_inner = torch._dynamo.lookup_backend(inner)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        tx = InstructionTranslator.current_tx()
        ops = [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes if n.op == "call_function"]
        seen.append((tx.f_code.co_filename, ops))
        return compile_inner(gm, example_inputs)

    return backend, seen


def _cold_program(name: str) -> dict[str, Any]:
    """Runs ``name`` in a fresh interpreter and returns what it printed (JSON)."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), name],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _training_cold() -> dict[str, Any]:
    assert "torch._dynamo" not in sys.modules  # nothing has been compiled in this interpreter
    backend, seen = _graphs_recorded("inductor")
    compiled = _train([0, 1, 2, 3], backend)
    fshard.clear_caches()
    eager = _train([0, 1, 2, 3], None)
    return {"compiled": compiled, "eager": eager, "graphs": seen}


def _fullgraph_body_cold() -> dict[str, Any]:
    ranks = [0, 1, 2, 3]
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    w = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    body = torch.compile(lambda xb, wb: torch.tanh(xb @ wb) * 2, fullgraph=True)
    f = fshard.shard_map(
        body, in_specs=(fshard.Chunk(0, ranks), fshard.Replicated(ranks)), out_specs=fshard.Chunk(0, ranks)
    )
    got = fshard.gather(f(x, w))
    got.pow(2).sum().backward()
    grad, w.grad = w.grad, None
    want = torch.tanh(x @ w) * 2
    want.pow(2).sum().backward()
    return {
        "got": got.detach().flatten().tolist(),
        "want": want.detach().flatten().tolist(),
        "grad": grad.flatten().tolist(),
        "want_grad": w.grad.flatten().tolist(),
    }


def _module_steps(compiler: Any, steps: int = 3) -> list[float]:
    """Losses of ``steps`` SGD steps through the module API (fully sharded), compiled with ``compiler`` unless None."""
    ranks = [0, 1, 2, 3]
    model = _model().double()
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(ranks))
    opt = torch.optim.SGD(optree.tree_leaves(params), lr=0.1)
    rows = fshard.Chunk(0, ranks)
    summed = fshard.Partial(fshard.Replicated(ranks))
    x = torch.randn(32, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def squared_error(module: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(module(xb), yb, reduction="sum")[None]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        total, _ = fshard.apply_module(
            model, params, buffers, fshard.shard(x, rows), fshard.shard(y, rows), method=squared_error, out_specs=summed
        )
        loss = fshard.gather(total)[0] / y.numel()
        loss.backward()
        opt.step()
        return loss.detach()

    if compiler is not None:
        step = torch.compile(step, backend=compiler)
    return [step(x, y).item() for _ in range(steps)]


def _module_api_cold() -> dict[str, Any]:
    assert "torch._dynamo" not in sys.modules  # nothing has been compiled in this interpreter
    backend, seen = _graphs_recorded("aot_eager")
    compiled = _module_steps(backend)
    fshard.clear_caches()
    return {"compiled": compiled, "eager": _module_steps(None), "graphs": seen}


def _psum_body_cold() -> dict[str, Any]:
    """A compiled step whose shard_map body calls psum, its first call compiled: psum runs eagerly inside it."""
    ranks = [0, 1, 2, 3]
    f = fshard.shard_map(
        lambda b: torch.cos(fshard.psum(torch.sin(b) * 3, "x")) + 1,
        fshard.Chunk(0, ranks),
        fshard.Chunk(0, ranks),
        check_vma=False,
    )
    x = torch.arange(8.0, dtype=torch.float64)
    step = torch.compile(lambda t: fshard.gather(f(t)).sum() * 2, backend="aot_eager")
    compiled = [float(step(x)) for _ in range(3)]
    parts = torch.sin(x).reshape(4, 2) * 3
    return {"compiled": compiled, "want": float((torch.cos(parts.sum(0)) + 1).sum() * 4 * 2)}


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(p - q) for p, q in zip(a, b))


def test_a_training_step_compiles_from_a_cold_start_and_gives_the_eager_losses() -> None:
    got = _cold_program("_training_cold")
    compiled, eager = got["compiled"], got["eager"]
    assert len(compiled["losses"]) == 3
    assert _max_diff(compiled["losses"], eager["losses"]) <= 1e-12
    assert _max_diff(compiled["out"], eager["out"]) <= 1e-12
    assert compiled["losses"][2] < compiled["losses"][0]  # it trains
    files = [f for f, _ in got["graphs"]]
    assert not [f for f in files if f.startswith((FSHARD_DIR, BACKENDS_DIR))]  # movement stays out of the graphs
    body = [ops for f, ops in got["graphs"] if f == os.path.abspath(__file__) and "tanh" in ops and "mse_loss" in ops]
    assert body  # the shard_map body was compiled: linear, tanh, linear and the loss in one graph


def test_a_fullgraph_compiled_shard_map_body_runs_from_a_cold_start() -> None:
    got = _cold_program("_fullgraph_body_cold")
    assert _max_diff(got["got"], got["want"]) <= 1e-12
    assert _max_diff(got["grad"], got["want_grad"]) <= 1e-12


def test_a_step_through_the_module_api_compiles_from_a_cold_start() -> None:
    got = _cold_program("_module_api_cold")
    assert len(got["compiled"]) == 3
    assert _max_diff(got["compiled"], got["eager"]) <= 1e-12
    assert got["compiled"][2] < got["compiled"][0]  # it trains
    ours = {f for f, _ in got["graphs"] if f.startswith((FSHARD_DIR, BACKENDS_DIR))}
    assert ours == {os.path.join(FSHARD_DIR, "_api", "module_apply.py")}  # only the body that runs the module
    body = [ops for _, ops in got["graphs"] if "mse_loss" in ops]
    assert body  # the module's forward and the per-block loss, compiled where apply_module runs them
    assert all("linear" in ops and "tanh" in ops for ops in body)


def test_a_step_whose_body_calls_psum_compiles_from_a_cold_start() -> None:
    got = _cold_program("_psum_body_cold")
    assert _max_diff(got["compiled"], [got["want"]] * 3) <= 1e-12


def _training_on_the_pool() -> dict[str, Any]:
    fshard.clear_caches()
    torch._dynamo.reset()
    compiled = _train([0, 1, 2, 3], "aot_eager")
    torch._dynamo.reset()
    fshard.clear_caches()
    return {"compiled": compiled, "eager": _train([0, 1, 2, 3], None)}


@pytest.mark.multiprocess
def test_a_training_step_compiles_on_four_gloo_processes(dist_pool) -> None:
    results = dist_pool.run(_training_on_the_pool, timeout=300)
    for got in results:
        assert _max_diff(got["compiled"]["losses"], got["eager"]["losses"]) <= 1e-12
        assert _max_diff(got["compiled"]["out"], got["eager"]["out"]) <= 1e-12
    assert all(got["eager"] == results[0]["eager"] for got in results)  # the ranks agree


def _steps_across_processes(compiler: Any, steps: int = 5) -> dict[str, Any]:
    """``steps`` compiled (or eager) SGD steps whose ``shard_map`` body gets new tensors at each step.

    The parameters are replicated (their blocks tapped), the batch is new at each step, the body
    closes over a tensor that needs a gradient and over a tensor gathered at each step. Returns the
    losses, the closed-over tensor's gradient at each step, and TorchDynamo's count of frames
    compiled after each step.
    """
    ranks = [0, 1, 2, 3]
    model = _model().double()
    params = fshard.shard_params(model, lambda name, t: fshard.Replicated(ranks))
    leaves = [t.requires_grad_() for t in optree.tree_leaves(params)]
    scale = torch.tensor([1.5], dtype=torch.float64, requires_grad=True)
    bias = fshard.shard(torch.zeros(4, dtype=torch.float64), fshard.Chunk(0, ranks))
    leaves += [t.requires_grad_() for t in bias.addressable_data]
    opt = torch.optim.SGD([*leaves, scale], lr=0.1)
    rows, summed = fshard.Chunk(0, ranks), fshard.Partial(fshard.Replicated(ranks))
    gathered: dict[str, torch.Tensor] = {}

    def block_loss(xb: torch.Tensor, yb: torch.Tensor, ws: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.func.functional_call(model, ws, (xb,)) * scale + gathered["bias"]
        return torch.nn.functional.mse_loss(out, yb, reduction="sum")[None]

    loss_of = fshard.shard_map(block_loss, in_specs=(rows, rows, fshard.Replicated(ranks)), out_specs=summed)

    def step(x: fshard.ShardedArray, y: fshard.ShardedArray) -> torch.Tensor:
        opt.zero_grad()
        gathered["bias"] = fshard.gather(bias)
        loss = fshard.gather(loss_of(x, y, params))[0] / 32
        loss.backward()
        opt.step()
        return loss.detach()

    if compiler is not None:
        step = torch.compile(step, backend=compiler)
    losses, grads, frames = [], [], []
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        x = fshard.shard(torch.randn(32, 8, dtype=torch.float64, generator=g), rows)
        y = fshard.shard(torch.randn(32, 4, dtype=torch.float64, generator=g), rows)
        losses.append(step(x, y).item())
        grads.append(float(scale.grad))  # pyright: ignore[reportArgumentType]
        frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    return {"losses": losses, "grads": grads, "frames": frames}


def _new_tensors_each_step_on_the_pool() -> dict[str, Any]:
    fshard.clear_caches()
    torch._dynamo.reset()
    compiled = _steps_across_processes("aot_eager")
    torch._dynamo.reset()
    fshard.clear_caches()
    return {"compiled": compiled, "eager": _steps_across_processes(None)}


@pytest.mark.multiprocess
def test_a_compiled_step_across_processes_is_not_traced_again_for_each_steps_new_tensors(dist_pool) -> None:
    """The per-shard mode's lookups of a body's tensors run eagerly: no guard on a tensor's identity.

    Traced, each step's new batch, gathered tensor and taps failed the guards of the last step's, and
    TorchDynamo traced the body's frames again at every step, up to its recompile limit.
    """
    for got in dist_pool.run(_new_tensors_each_step_on_the_pool, timeout=300):
        compiled, eager = got["compiled"], got["eager"]
        assert compiled["frames"][1:] == [compiled["frames"][1]] * 4  # nothing compiled after the second step
        assert _max_diff(compiled["losses"], eager["losses"]) <= 1e-12
        assert _max_diff(compiled["grads"], eager["grads"]) <= 1e-12  # the closed-over tensor's summed gradient
        assert eager["grads"][0] != 0.0


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))
