"""fshard's public functions are each the one that its ``collective`` decorator names, and each is opaque.

``collective(name)`` makes a function a boundary of a compiled graph and a call that check
mode makes the ranks agree on; a decorator that ends up on another function (a helper
inserted between them) would silently leave the public one without either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import fshard

PACKAGE = Path(fshard.__file__).parent


def _decorated() -> list[tuple[str, str, str]]:
    """Every ``@collective("name")`` in the package: (file, the name it gives, the function it decorates)."""
    out: list[tuple[str, str, str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for deco in node.decorator_list:
                if (
                    isinstance(deco, ast.Call)
                    and isinstance(deco.func, ast.Name)
                    and deco.func.id == "collective"
                    and deco.args
                    and isinstance(deco.args[0], ast.Constant)
                    and isinstance(deco.args[0].value, str)
                ):
                    out.append((str(path.relative_to(PACKAGE)), deco.args[0].value, node.name))
    return out


DECORATED = _decorated()


def test_the_package_has_its_collectives() -> None:
    names = {n for _, n, _ in DECORATED}
    assert {"apply_module", "shard", "reshard", "gather", "map_local", "from_local_tensor"} <= names


@pytest.mark.parametrize(("where", "name", "function"), DECORATED, ids=[n for _, n, _ in DECORATED])
def test_each_collective_decorates_the_public_function_it_names(where: str, name: str, function: str) -> None:
    assert function == name, f"{where}: @collective({name!r}) decorates {function}()"
    public = getattr(fshard, name)
    assert getattr(public, "_torchdynamo_disable", False), f"fshard.{name} is not opaque under torch.compile"


def test_a_compiled_step_that_calls_apply_module_gives_the_eager_result() -> None:
    from torch._dynamo.testing import CompileCounter

    ranks = [0, 1, 2, 3]
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    params, buffers = fshard.shard_module(module, fshard.fully_sharded(ranks))
    x = torch.randn(8, 3)

    def step(x: torch.Tensor) -> torch.Tensor:
        out, _ = fshard.apply_module(module, params, buffers, fshard.shard(x, fshard.Chunk(0, ranks)))
        return fshard.gather(out)

    torch._dynamo.reset()  # pyright: ignore[reportPrivateImportUsage]
    got = torch.compile(step, backend=CompileCounter())(x)  # traced into, apply_module fails (numpy's setflags)
    assert torch.equal(got, step(x))
