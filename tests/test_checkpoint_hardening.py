"""Checkpoints under attack: links out of the directory, racing saves and loads, crafted indexes,
conj/neg views, full disks and file-size limits, and a leader that dies after its commit.

Every test here failed before the fix it covers.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import SafetensorError

import fshard
from fshard._checkpoint import _reader, _save, _write
from fshard._checkpoint._format import index_digest
from fshard.backends.local import LOCAL

X = torch.arange(48.0).reshape(8, 6)
ROWS = fshard.Chunk(0, [0, 1])


def _save_x(path: Path, x: torch.Tensor = X, step: int = 1) -> None:
    fshard.save(path, {"x": fshard.shard(x, ROWS), "step": step})


def _load_x(path: Path) -> tuple[torch.Tensor, int]:
    out = fshard.load(path)
    return fshard.gather(out["x"]), out["step"]


def _index(root: Path) -> dict[str, Any]:
    return json.loads((root / "index.json").read_text())


def _listing(root: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in root.iterdir())


# -- S-2: nothing outside the checkpoint directory is read -------------------------------------


def test_a_data_file_linked_outside_the_checkpoint_is_refused(tmp_path):
    root, outside = tmp_path / "ck", tmp_path / "elsewhere.safetensors"
    _save_x(root)
    victim = root / _index(root)["data"] / "rank-00000.safetensors"
    victim.rename(outside)  # the same bytes: only where they live is wrong
    victim.symlink_to(outside)
    with pytest.raises(fshard.CheckpointError, match=re.escape(f"resolves to {outside}, outside the checkpoint")):
        fshard.load(root)


def test_a_data_directory_linked_outside_the_checkpoint_is_refused(tmp_path):
    root, outside = tmp_path / "ck", tmp_path / "elsewhere"
    _save_x(root)
    data = root / _index(root)["data"]
    data.rename(outside)
    data.symlink_to(outside, target_is_directory=True)
    with pytest.raises(
        fshard.CheckpointError,
        match=rf"{re.escape(str(data))} resolves to {re.escape(str(outside))}, outside the checkpoint",
    ):
        fshard.load(root, verify=False)


def test_an_index_linked_outside_the_checkpoint_is_refused(tmp_path):
    root, outside = tmp_path / "ck", tmp_path / "elsewhere.json"
    _save_x(root)
    (root / "index.json").rename(outside)
    (root / "index.json").symlink_to(outside)
    message = re.escape(f"{root / 'index.json'} resolves to {outside}, outside the checkpoint directory {root}")
    with pytest.raises(fshard.CheckpointError, match=message):
        fshard.load(root)
    with pytest.raises(fshard.CheckpointError, match=message):
        fshard.checkpoint_info(root)


def test_a_checkpoint_reached_through_a_link_still_loads(tmp_path):
    _save_x(tmp_path / "ck", step=4)
    (tmp_path / "link").symlink_to(tmp_path / "ck", target_is_directory=True)
    x, step = _load_x(tmp_path / "link")
    assert torch.equal(x, X)
    assert step == 4


# -- W-3: one save at a time per path ----------------------------------------------------------


def _flock(root: Path) -> int:
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "save.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_save_while_another_holds_the_path_is_refused_and_writes_nothing(tmp_path):
    root = tmp_path / "ck"
    _save_x(root, step=1)
    before = sorted(p.name for p in root.iterdir())
    fd = _flock(root)  # another process's save, between its first write and its commit
    try:
        with pytest.raises(fshard.CheckpointError, match=re.escape(f"Checkpoint path {root} is being written by")):
            _save_x(root, X + 1, step=2)
    finally:
        os.close(fd)
    assert sorted(p.name for p in root.iterdir()) == sorted([*before, "save.lock"])  # no new data directory
    assert _load_x(root)[1] == 1
    _save_x(root, X + 1, step=2)  # the lock is free again
    assert _load_x(root)[1] == 2
    assert _listing(root) == ["data", "index"]  # the lock file goes with the save that took it


@pytest.mark.parametrize("committed_before", [True, False], ids=["over-a-checkpoint", "new-directory"])
def test_a_lock_file_left_by_a_killed_save_holds_nothing(tmp_path, committed_before):
    root = tmp_path / "ck"
    if committed_before:
        _save_x(root, step=1)
    root.mkdir(exist_ok=True)
    (root / "save.lock").touch()  # its saver was killed: the kernel released the lock, the file stays
    if committed_before:
        assert _load_x(root)[1] == 1  # load ignores it
    _save_x(root, X + 1, step=2)
    assert _load_x(root)[1] == 2
    assert _listing(root) == ["data", "index"]


def test_a_save_racing_a_slow_save_to_the_same_path_is_refused(tmp_path, monkeypatch):
    root, inside, go = tmp_path / "ck", threading.Event(), threading.Event()
    real, outcome = _write.save_file, {}

    def slow(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "slow-save":
            inside.set()
            go.wait(30)
        real(*args, **kwargs)

    monkeypatch.setattr(_write, "save_file", slow)

    def first() -> None:
        try:
            _save_x(root, X + 1, step=1)
            outcome["first"] = "saved"
        except Exception as exc:  # reported below
            outcome["first"] = repr(exc)

    t = threading.Thread(target=first, name="slow-save")
    t.start()
    try:
        assert inside.wait(30)
        with pytest.raises(fshard.CheckpointError, match="another save holds it"):
            _save_x(root, X + 2, step=2)
    finally:
        go.set()
        t.join(30)
    assert outcome == {"first": "saved"}
    x, step = _load_x(root)
    assert step == 1
    assert torch.equal(x, X + 1)


def test_racing_saves_in_threads_leave_a_whole_checkpoint(tmp_path):
    root, deadline = tmp_path / "ck", time.monotonic() + 3.0
    results: dict[int, list[str]] = {1: [], 2: []}

    def saver(k: int) -> None:
        while time.monotonic() < deadline:
            try:
                _save_x(root, X * k, step=k)
                results[k].append("saved")
            except fshard.CheckpointError as exc:
                results[k].append("refused" if "another save holds it" in str(exc) else repr(exc))
            except Exception as exc:  # any other outcome fails the test below
                results[k].append(repr(exc))

    threads = [threading.Thread(target=saver, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    outcomes = {r for rs in results.values() for r in rs}
    assert outcomes <= {"saved", "refused"}, outcomes
    assert "saved" in outcomes
    x, step = _load_x(root)
    assert torch.equal(x, X * step)
    assert _listing(root) == ["data", "index"]


def _save_rows(path: str, step: int) -> str:
    try:
        fshard.save(path, {"x": fshard.shard(X, fshard.Chunk(0, [0, 1, 2, 3])), "step": step})
    except fshard.CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return "saved"


@pytest.mark.multiprocess
def test_every_rank_learns_that_the_path_is_held(dist_pool, tmp_path):
    root = tmp_path / "ck"
    assert dist_pool.run(_save_rows, str(root), 1, timeout=60) == ["saved"] * 4
    fd = _flock(root)
    try:
        errors = dist_pool.run(_save_rows, str(root), 2, timeout=60)
    finally:
        os.close(fd)
    assert errors[0].startswith(f"CheckpointError: Checkpoint path {root} is being written by another save")
    for e in errors[1:]:
        assert e.startswith("CheckpointError: fshard.save failed on rank 0: CheckpointError: Checkpoint path")
    assert fshard.load(root, backend=LOCAL)["step"] == 1
    assert _listing(root) == ["data", "index", "save"]  # the other save's lock file is not this save's to remove


# -- C-1: a file that vanishes while load opens it makes the load start over ---------------------


def test_a_file_vanishing_inside_safe_open_starts_the_load_over(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    _save_x(root, step=1)
    real, calls = _reader.safe_open, []

    def racing(path: str, framework: str) -> Any:
        calls.append(path)
        if len(calls) == 1:  # a save commits and deletes this file between stat and open
            _save_x(root, X + 1, step=2)
            torch.UntypedStorage.from_file(path, False, 8)  # what safe_open meets: torch opens the path again
        return real(path, framework=framework)

    monkeypatch.setattr(_reader, "safe_open", racing)
    x, step = _load_x(root)
    assert step == 2
    assert torch.equal(x, X + 1)
    assert len(calls) > 1


_SAVER = """
import sys, time, torch, fshard
root, seconds = sys.argv[1], float(sys.argv[2])
x, k, end = torch.arange(48.0).reshape(8, 6), 0, time.monotonic() + seconds
while time.monotonic() < end:
    k += 1
    fshard.save(root, {"x": fshard.shard(x + k, fshard.Chunk(0, [0, 1])), "step": k})
print(k)
"""


def test_loads_racing_saves_in_another_process_see_one_whole_checkpoint(tmp_path):
    root = tmp_path / "ck"
    _save_x(root, X, step=0)
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, str(root), "3"], stdout=subprocess.PIPE, text=True)
    loads, restarts, deadline = 0, 0, time.monotonic() + 120
    try:
        while _index(root)["leaves"][1]["value"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the saver has started
        while saver.poll() is None and time.monotonic() < deadline:
            try:
                x, step = _load_x(root)
            except fshard.CheckpointError as exc:  # the one failure a load racing saves may report
                if "changed during load 3 times in a row" not in str(exc):
                    raise
                restarts += 1
                continue
            assert torch.equal(x, X + step)
            loads += 1
    finally:
        if saver.poll() is None:
            saver.kill()
        out, _ = saver.communicate(timeout=30)
    assert saver.returncode == 0
    assert int(out) > 1
    assert loads > 0


# -- C-3: declared sizes are checked against the files before anything is allocated -------------


@pytest.mark.parametrize("specs", [None, fshard.Chunk(0, [0, 1])], ids=["as-saved", "two-ranks"])
def test_a_crafted_index_declaring_a_huge_tensor_allocates_nothing(tmp_path, specs):
    root = tmp_path / "ck"
    fshard.save(root, {"t": torch.ones(2, 2)})
    index = _index(root)
    n = 1 << 20  # 2**40 float32 elements: 4 TiB
    leaf = index["leaves"][0]
    leaf["shape"] = leaf["boxes"][0]["sizes"] = [n, n]
    index["files"]["rank-00000.safetensors"]["bytes"] = n * n * 4
    index["digest"] = index_digest(index)
    (root / "index.json").write_text(json.dumps(index))
    real = (root / index["data"] / "rank-00000.safetensors").stat().st_size
    message = f"has {real} bytes, index.json records {n * n * 4}"
    with pytest.raises(fshard.CheckpointError, match=re.escape(message)):
        fshard.load(root, specs={"t": specs})


# -- C-5: conj and neg views save the values they show ------------------------------------------


def test_conj_and_neg_views_save_the_values_they_show(tmp_path):
    z = torch.complex(torch.arange(6.0), -torch.arange(6.0) - 1).reshape(2, 3)
    tree = {
        "conj": z.conj(),
        "imag-of-conj": z.conj().imag,
        "neg": torch._neg_view(torch.arange(4.0)),
        "array": fshard.shard(z.conj(), ROWS),
    }
    assert [tree["conj"].is_conj(), tree["imag-of-conj"].is_neg(), tree["neg"].is_neg()] == [True] * 3
    fshard.save(tmp_path / "ck", tree)
    out = fshard.load(tmp_path / "ck")
    assert torch.equal(out["conj"], z.conj().resolve_conj())
    assert out["conj"][0, 1].item() == complex(1.0, 2.0)
    assert torch.equal(out["imag-of-conj"], torch.arange(1.0, 7.0).reshape(2, 3))
    assert out["neg"].tolist() == [-0.0, -1.0, -2.0, -3.0]
    assert torch.equal(fshard.gather(out["array"]), z.conj().resolve_conj())


# -- C-7, C-8: full disks, file-size limits and odd entries raise CheckpointError -----------------


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"), "No space"),
        (SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)"), "Read-only"),
        (OSError(28, "No space left on device"), "No space left on device"),
    ],
    ids=["disk-full", "read-only", "os-error"],
)
def test_a_failing_data_write_raises_checkpoint_error_and_keeps_the_old_checkpoint(tmp_path, monkeypatch, error, cause):
    root = tmp_path / "ck"
    _save_x(root, step=1)

    def fail(tensors: Any, path: str, metadata: Any) -> None:
        raise error

    monkeypatch.setattr(_write, "save_file", fail)
    at = re.escape(str(root))
    with pytest.raises(
        fshard.CheckpointError,
        match=rf"Saving checkpoint {at} failed writing {at}/data\.[0-9a-f]{{32}}/rank-00000\.safetensors: .*{cause}",
    ):
        _save_x(root, X + 1, step=2)
    monkeypatch.undo()
    assert _load_x(root)[1] == 1
    assert _listing(root) == ["data", "index"]


def test_a_failing_index_write_raises_checkpoint_error_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    _save_x(root, step=1)

    def full(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith(".tmp"):
            raise OSError(28, "No space left on device", str(file))
        return open(file, *args, **kwargs)

    monkeypatch.setattr(_write, "open", full, raising=False)
    with pytest.raises(fshard.CheckpointError, match=r"failed writing .*index\.json\.[0-9a-f]{32}\.tmp: No space left"):
        _save_x(root, X + 1, step=2)
    monkeypatch.undo()
    assert _load_x(root)[1] == 1
    assert _listing(root) == ["data", "index"]


_FSIZE = """
import resource, signal, sys, torch, fshard
root = sys.argv[1]
fshard.save(root, {"x": torch.zeros(16), "step": 1})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
try:
    fshard.save(root, {"x": torch.ones(int(sys.argv[3])), "step": 2, "pad": ["p" * 100] * int(sys.argv[4])})
    print("saved")
except Exception as exc:
    print(type(exc).__name__, exc)
print("step", fshard.load(root)["step"])
"""


@pytest.mark.parametrize(
    ("limit", "numel", "pad", "where"),
    [(4096, 4096, 0, r"rank-00000\.safetensors"), (4096, 16, 100, r"index\.json\.[0-9a-f]{32}\.tmp")],
    ids=["data-file", "index"],
)
def test_a_file_size_limit_raises_checkpoint_error_and_keeps_the_old_checkpoint(tmp_path, limit, numel, pad, where):
    root = tmp_path / "ck"
    args = [sys.executable, "-c", _FSIZE, str(root), str(limit), str(numel), str(pad)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    at = re.escape(str(root))
    assert re.fullmatch(rf"CheckpointError Saving checkpoint {at} failed writing {at}/.*{where}: .*", lines[0])
    assert "File too large" in lines[0]
    assert lines[1] == "step 1"
    assert _listing(root) == ["data", "index"]


def test_an_index_that_is_a_directory_is_refused_before_anything_is_written(tmp_path):
    root = tmp_path / "ck"
    _save_x(root, step=1)
    (root / "index.json").unlink()
    (root / "index.json").mkdir()
    before = sorted(p.name for p in root.iterdir())
    message = f"Checkpoint path {root} holds {root / 'index.json'}, which is not a file"
    with pytest.raises(fshard.CheckpointError, match=re.escape(message)):
        _save_x(root, step=2)
    assert sorted(p.name for p in root.iterdir()) == before
    with pytest.raises(fshard.CheckpointError, match=re.escape(f"{root / 'index.json'} is not a file")):
        fshard.load(root)


# -- Messages: a save whose index landed succeeded, whatever failed after -----------------------


def test_a_failure_after_the_commit_rename_does_not_fail_the_save(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    _save_x(root, step=1)
    real = _save.commit

    def commit_then_fail(*args: Any) -> None:
        real(*args)
        raise OSError(5, "Input/output error")  # say, the directory fsync after the rename

    monkeypatch.setattr(_save, "commit", commit_then_fail)
    _save_x(root, X + 1, step=2)
    monkeypatch.undo()
    x, step = _load_x(root)
    assert step == 2
    assert torch.equal(x, X + 1)


def _save_with_leader_killed_after_commit(path: str, out: str) -> str:
    if dist.get_rank() == 0:
        real = _save.commit

        def commit_then_die(*args: Any) -> None:
            real(*args)
            os._exit(0)  # killed right after the rename

        _save.commit = commit_then_die
    try:
        fshard.save(path, {"x": fshard.shard(X + 1, fshard.Chunk(0, [0, 1, 2, 3])), "step": 2})
        outcome = "saved"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank-{dist.get_rank()}").write_text(outcome)
    return outcome


@pytest.mark.multiprocess
def test_survivors_of_a_leader_killed_after_the_commit_report_success(dist_pool, tmp_path):
    from _pool import RankFailure

    root, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    assert dist_pool.run(_save_rows, str(root), 1, timeout=60) == ["saved"] * 4
    with pytest.raises(RankFailure, match="worker 0 died"):
        dist_pool.run(_save_with_leader_killed_after_commit, str(root), str(out), timeout=60)
    assert sorted(p.name for p in out.iterdir()) == ["rank-1", "rank-2", "rank-3"]
    assert [(out / f"rank-{k}").read_text() for k in (1, 2, 3)] == ["saved"] * 3
    saved = fshard.load(root, backend=LOCAL)
    assert saved["step"] == 2
    assert torch.equal(fshard.gather(saved["x"]), X + 1)


def test_a_save_whose_files_another_save_deleted_does_not_commit(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    _save_x(root, step=1)
    real = _save.write_files

    def then_deleted(*args: Any) -> Any:
        written = real(*args)
        (args[1] / "rank-00000.safetensors").unlink()  # a save that committed in between took it as old data
        return written

    monkeypatch.setattr(_save, "write_files", then_deleted)
    with pytest.raises(
        fshard.CheckpointError, match=r"rank-00000\.safetensors is gone before the commit .* another save"
    ):
        _save_x(root, X + 1, step=2)
    monkeypatch.undo()
    assert _load_x(root)[1] == 1
    assert _listing(root) == ["data", "index"]
