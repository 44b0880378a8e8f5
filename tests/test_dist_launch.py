"""launch(): fresh Gloo processes for scripts and benchmarks; the quickstart on both backends."""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.testing.launch import launch

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


def _reshard_job(n):
    x = torch.arange(float(n * 4)).reshape(4, n)
    a = fshard.shard(x, fshard.Chunk(0, list(range(dist.get_world_size()))))
    b = fshard.reshard(a, fshard.Chunk(1, list(range(dist.get_world_size()))[::-1]))
    return dist.get_rank(), torch.equal(fshard.gather(b), x)


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("rank one is unhappy")
    dist.barrier()


def _sleep():
    time.sleep(60)


def test_launch_returns_results_in_rank_order():
    assert launch(_reshard_job, 3, 5) == [(0, True), (1, True), (2, True)]


def _many_tensors():
    return {i: torch.full((100,), float(dist.get_rank() * 1000 + i)) for i in range(200)}


def _unpicklable():
    return lambda: None


def test_launch_returns_tensors_and_names_an_unpicklable_result():
    """Tensors went through shared memory, whose descriptors a rank that had exited could no longer hand over."""
    got = launch(_many_tensors, 4)
    assert [[float(t[0]) for t in r.values()] for r in got] == [[r * 1000.0 + i for i in range(200)] for r in range(4)]
    with pytest.raises(RuntimeError, match=r"failed on rank \d:(.|\n)*(PicklingError|AttributeError): Can.t pickle"):
        launch(_unpicklable, 2)


def test_launch_reports_the_failing_rank_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed on rank 1:(.|\n)*KeyError: 'rank one is unhappy'"):
        launch(_fail_on_rank_one, 2)
    assert time.monotonic() - start < 30


def _exit_on_rank_one(code):
    if dist.get_rank() == 1:
        os._exit(code)  # no result, no traceback: only the process's end tells what happened
    return dist.get_rank()


def _killed_on_rank_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()


def test_launch_names_how_a_rank_that_sent_no_result_ended():
    with pytest.raises(RuntimeError, match=r"rank 1 exited without a result \(exit code 3\)"):
        launch(_exit_on_rank_one, 2, 3, timeout=60)
    with pytest.raises(RuntimeError, match=r"rank 1 exited without a result \(killed by SIGKILL\)"):
        launch(_killed_on_rank_one, 2, timeout=60)


def test_launch_times_out_and_stops_the_processes():
    with pytest.raises(TimeoutError, match=r"timed out after 2 s; ranks \[0, 1\] did not finish"):
        launch(_sleep, 2, timeout=2)


def test_quickstart_runs_on_the_local_backend(capsys):
    result = runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="quickstart")["main"]()
    assert result == {"rank": 0, "world": 4, "ok": True, "sent": 72}
    assert "rand is layout-invariant: True" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun on PATH")
def test_quickstart_runs_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(ROOT / "examples" / "quickstart.py"),
    ]
    # A session of its own, so that a hang is cleaned up with every worker torchrun started.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("torchrun examples/quickstart.py did not finish in 120 s")
    assert proc.returncode == 0, err[-3000:]
    assert out.count("rand is layout-invariant: True") == 1  # only rank 0 prints
    assert "backend=torch_dist" in out
    assert "rows -> columns: 72 elements sent (minimum 72)" in out


def test_launch_refuses_a_timeout_that_is_not_a_positive_number():
    with pytest.raises(ValueError, match=r"launch\(\) needs a timeout of some seconds, a positive number, got None"):
        launch(abs, 1, -3, timeout=None)
