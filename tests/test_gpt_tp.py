"""examples/gpt_tp.py: a GPT trained TP+DP with psum, 5 SGD steps equal to the unsharded model.

On the local backend (a 2 x 2 mesh in this process) and on the 4 Gloo processes of the pool;
and the program stays short (its lines of code, docstrings and comments aside).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.distributed as dist
from test_examples import EXAMPLES, example


def _losses_and_ok(result: dict) -> tuple[list[float], list[float], list[str], bool]:
    return result["losses"], result["reference"], result["bad"], result["ok"]


def test_five_steps_on_a_2x2_mesh_match_the_unsharded_model_locally():
    losses, reference, bad, ok = _losses_and_ok(example("gpt_tp").check(range(4)))
    assert bad == []
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-12
    assert ok


def test_the_script_checks_1_2_and_4_ranks(capsys):
    assert example("gpt_tp").main(["--ranks", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp=1, tp=1" in out
    assert "dp=1, tp=2" in out


def _on_gloo() -> tuple[list[float], list[float], list[str], bool]:
    return _losses_and_ok(example("gpt_tp").check(range(dist.get_world_size())))


@pytest.mark.multiprocess
def test_five_steps_on_4_gloo_processes_match_the_unsharded_model(dist_pool):
    local = example("gpt_tp").check(range(4))
    for rank, (losses, reference, bad, ok) in enumerate(dist_pool.run(_on_gloo, timeout=300)):
        assert bad == [], f"rank {rank}"
        assert ok, f"rank {rank}"
        assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-12
        assert max(abs(a - b) for a, b in zip(losses, local["losses"])) <= 1e-12


def _code_lines(path: Path, names: set[str]) -> int:
    """Lines of code of the module-level functions ``names``: no blank, comment or docstring lines."""
    source = path.read_text()
    lines, tree = source.splitlines(), ast.parse(source)
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None:
            docs.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return sum(
        1
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in names
        for n in range(node.lineno, node.end_lineno + 1)
        if n not in docs and lines[n - 1].strip() and not lines[n - 1].strip().startswith("#")
    )


def test_the_program_is_29_lines_of_code():
    # The program: the parameters' specs and the step (the model's forward, gpt(), is model code).
    assert _code_lines(EXAMPLES / "gpt_tp.py", {"tp_specs", "tp_program"}) == 29
