"""The command line and the example scripts: version, help, bad arguments, bench from an install, logging."""

from __future__ import annotations

import logging
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


# -- fshard / python -m fshard ------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"], prog="fshard")
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"fshard {fshard.__version__}\n"


@pytest.mark.parametrize(
    ("argv0", "prog"),
    [("/venv/bin/fshard", "fshard"), ("/src/fshard/__main__.py", "python -m fshard"), ("", "python -m fshard")],
    ids=["console-script", "python-m", "embedded"],
)
def test_help_names_the_program_that_ran(
    argv0: str, prog: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert capsys.readouterr().out.startswith(f"usage: {prog} [-h] [--version] {{demo,bench,convert,info}}")


def test_demo_help_names_the_program(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"], prog="fshard")
    assert capsys.readouterr().out.startswith("usage: fshard demo [-h] [--world WORLD]")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bogus"], "invalid choice: 'bogus' (choose from 'demo', 'bench', 'convert', 'info')"),
        ([], "the following arguments are required: {demo,bench,convert,info}"),
        (["demo", "--world", "0"], "--world must be at least 1, got 0"),
        (["demo", "--color", "pink"], "argument --color: invalid choice: 'pink'"),
    ],
    ids=["unknown-command", "no-command", "demo-world", "demo-color"],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv, prog="fshard")
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_without_the_bench_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda n: None if n == "matplotlib" else find_spec(n))
    assert cli.main(["bench", "--quick"], prog="fshard") == 2
    assert capsys.readouterr().err == (
        "fshard bench needs matplotlib, from the bench extra: pip install 'fshard[bench]'.\n"
    )


def test_bench_runs_from_an_installed_package(tmp_path: Path) -> None:
    """A copy of the package as a wheel lays it out (benchmarks/ as fshard/benchmarks/), run from elsewhere."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "fshard", site / "fshard", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("backends", "benchmarks"):
        shutil.copytree(ROOT / folder, site / "fshard" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = (
        "from fshard.__main__ import load_bench; bench = load_bench(); import fshard, fshard.benchmarks;"
        "print(fshard.__file__); print(fshard.benchmarks.__file__); print(bench.__module__)"
    )
    out = _run("-c", probe, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        str(site / "fshard" / "__init__.py"),
        str(site / "fshard" / "benchmarks" / "__init__.py"),
        "fshard.benchmarks.run",
    ]
    usage = _run("-m", "fshard", "bench", "--help", cwd=tmp_path, env=env)
    assert usage.returncode == 0, usage.stderr
    assert "--quick" in usage.stdout


# -- example scripts ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["quickstart", "embedding", "resume", "tp_mlp"])
def test_example_help(name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {name}.py [-h]")


@pytest.mark.parametrize(
    ("name", "argv", "message"),
    [
        ("quickstart", ["--world", "4"], "unrecognized arguments: --world 4"),
        ("embedding", ["--ranks", "0", "2"], "--ranks must all be at least 1, got [0, 2]"),
        ("embedding", ["--ranks", "x"], "argument --ranks: invalid int value: 'x'"),
        ("embedding", ["--world", "-1"], "--world must be at least 1 (or 0: no processes), got -1"),
        ("resume", ["--phase", "save"], "--phase runs one phase under torchrun"),
        ("resume", ["--dir", __file__], "is a file; give a directory for the checkpoint"),
        ("resume", ["--bogus"], "unrecognized arguments: --bogus"),
    ],
    ids=["quickstart-option", "ranks-zero", "ranks-text", "world-negative", "phase", "dir-file", "resume-option"],
)
def test_example_bad_arguments(
    name: str, argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


# -- logging --------------------------------------------------------------------------------


def test_the_fshard_logger_is_silent_by_default() -> None:
    logger = logging.getLogger("fshard")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert not logger.isEnabledFor(logging.DEBUG) or logging.getLogger().isEnabledFor(logging.DEBUG)


def test_a_reshard_logs_its_plan_and_bytes(caplog: pytest.LogCaptureFixture) -> None:
    x = fshard.shard(torch.ones(4, 2, dtype=torch.float64), fshard.Chunk(0, [0, 1]))
    with caplog.at_level(logging.DEBUG, logger="fshard"):
        fshard.reshard(x, fshard.Chunk(1, [0, 1]))
    assert [r.name for r in caplog.records] == ["fshard"]
    assert caplog.records[0].levelno == logging.DEBUG
    assert caplog.messages == [
        "local runs plan (4, 2): 2 -> 2 shards, 4 elements sent between ranks (the minimum): "
        "32 bytes of 8-byte elements"
    ]


def test_torch_dist_logs_its_rank(caplog: pytest.LogCaptureFixture) -> None:
    from fshard.backends.torch_dist import TorchDistBackend

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = fshard.shard(torch.ones(4), fshard.Chunk(0, [0, 0]), backend=TorchDistBackend())
        with caplog.at_level(logging.DEBUG, logger="fshard"):
            fshard.reshard(x, fshard.Replicated([0]))
    finally:
        dist.destroy_process_group()
    assert any(
        re.match(r"torch_dist \(rank 0\) runs plan \(4,\): 2 -> 1 shards, 0 elements .*; this rank sends 0 elements", m)
        for m in caplog.messages
    )
