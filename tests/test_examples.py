"""The research examples run and verify themselves: on the local backend, over the Gloo pool, and launched.

Each example's ``check`` compares against the unsharded computation and its ``main``
exits non-zero on a mismatch; these tests run both, on 1, 2 and 4 ranks.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.torch_dist import TorchDistBackend

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str) -> ModuleType:
    """The example script ``examples/<name>.py``, imported as the module ``name``.

    ``tp_mlp`` is imported first: ``resume`` imports it, as a script would from its folder.
    """
    if name in sys.modules:
        return sys.modules[name]
    if name != "tp_mlp":
        example("tp_mlp")
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def examples_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples' folder on ``sys.path`` for one test (spawned processes inherit it)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


# -- local backend ---------------------------------------------------------------------------


def test_tp_mlp_matches_the_unsharded_model_on_1_2_and_4_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    tp_mlp = example("tp_mlp")
    assert tp_mlp.main(["--ranks", "1", "2", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["1 ranks", "2 ranks", "4 ranks"]
    assert all(line.endswith(": ok") for line in lines)


def test_tp_mlp_reports_a_wrong_step(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    tp_mlp = example("tp_mlp")
    double = lambda params, grads: {  # noqa: E731
        k: fshard.map_local(lambda p, g: p - 2 * tp_mlp.LR * g, params[k], grads[k]) for k in params
    }
    monkeypatch.setattr(tp_mlp, "sgd", double)
    assert tp_mlp.main(["--ranks", "2"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_tp_mlp_replicated_bias_gets_the_whole_gradient_on_every_copy() -> None:
    tp_mlp = example("tp_mlp")
    net = tp_mlp.model()
    params = tp_mlp.shard_model(net, range(4))
    x, y = tp_mlp.batch(0)
    grads = torch.func.grad(tp_mlp.loss_fn)(params, x, y)
    torch.nn.functional.mse_loss(net(x), y).backward()
    copies = grads["2.bias"].addressable_data
    assert len(copies) == 4
    for copy in copies:
        torch.testing.assert_close(copy, net[2].bias.grad, rtol=1e-12, atol=1e-14)


def test_embedding_lookups_are_bit_identical(capsys: pytest.CaptureFixture[str]) -> None:
    embedding = example("embedding")
    assert embedding.main(["--ranks", "1", "2", "4", "7"]) == 0
    out = capsys.readouterr().out
    assert out.count("values equal, table gradient equal") == 8


def test_resume_on_2_ranks_continues_a_4_rank_run(capsys: pytest.CaptureFixture[str]) -> None:
    resume = example("resume")
    assert resume.main([]) == 0
    out = capsys.readouterr().out
    assert "saved after step 3 on 4 ranks, resumed on 2" in out
    assert "state after loading equals the saved state: yes" in out


def test_resume_checks_the_saved_state(tmp_path: Path) -> None:
    resume = example("resume")
    saved = resume.save_phase(str(tmp_path / "ckpt"), range(4))
    resumed = resume.resume_phase(str(tmp_path / "ckpt"), range(2))
    assert resumed["step"] == resume.SAVE_AT
    assert resumed["layouts"]["2.weight"] == fshard.Chunk(1, [0, 1]).layout((3, 10))
    assert resume.compare(saved, resumed)["ok"]
    tampered = {**resumed, "losses": [v + 1e-6 for v in resumed["losses"]]}
    assert not resume.compare(saved, tampered)["ok"]


# -- over the Gloo pool: 4 worker processes ------------------------------------------------------


def _subgroup_backend(n: int) -> TorchDistBackend | None:
    """A backend on global ranks ``0 .. n-1`` (every rank must call this); ``None`` off the group."""
    if n == dist.get_world_size():
        return TorchDistBackend()
    group = dist.new_group(list(range(n)))
    return TorchDistBackend(group) if dist.get_rank() < n else None


def _tp_mlp_on_groups() -> list[bool]:
    tp_mlp = example("tp_mlp")
    out = []
    for n in (1, 2, 4):
        backend = _subgroup_backend(n)
        if backend is not None:
            out.append(tp_mlp.check(range(n), backend)["ok"])
    return out


def _embedding() -> bool:
    return example("embedding").check(range(dist.get_world_size()))["ok"]


def _save(path: str) -> dict:
    return example("resume").save_phase(path, range(dist.get_world_size()))


def _resume_on_two(path: str) -> dict | None:
    backend = _subgroup_backend(2)
    return None if backend is None else example("resume").resume_phase(path, range(2), backend)


@pytest.mark.multiprocess
def test_tp_mlp_over_gloo_on_1_2_and_4_ranks(dist_pool) -> None:
    assert dist_pool.run(_tp_mlp_on_groups) == [[True, True, True], [True, True], [True], [True]]


@pytest.mark.multiprocess
def test_embedding_over_gloo(dist_pool) -> None:
    assert dist_pool.run(_embedding) == [True] * 4


@pytest.mark.multiprocess
def test_resume_over_gloo_saves_on_4_and_resumes_on_2(dist_pool, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = dist_pool.run(_save, path)
    resumed = dist_pool.run(_resume_on_two, path)
    assert resumed[2:] == [None, None]
    compare = example("resume").compare
    assert all(compare(s, r)["ok"] for s in saved for r in resumed[:2])


@pytest.mark.multiprocess
@pytest.mark.usefixtures("examples_path")
def test_tp_mlp_main_spawns_gloo_processes(capsys: pytest.CaptureFixture[str]) -> None:
    assert example("tp_mlp").main(["--world", "2"]) == 0
    assert capsys.readouterr().out.strip().startswith("2 ranks: loss")
