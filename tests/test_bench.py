"""The plumbing of ``python -m fshard bench``: command line, case list, results, table, JSON, plot.

No timing is asserted here. One tiny real run launches 2 Gloo processes and checks that
the distributed cases verify their results and count the minimal bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fshard.benchmarks import dist, report, run
from fshard.benchmarks.common import Row, Settings

ISSUE_CASES = {
    "gather-one": "gather",
    "gather-uneven": "gather",
    "gather-all": "gather",
    "dim0-dim1": "reshard",
    "grid-rows": "reshard",
    "repl-chunk": "reshard",
    "chunk-repl": "reshard",
    "explicit-chunk": "reshard",
    "shard-src0": "shard",
    "partial-repl": "reduce",
    "partial-chunk": "reduce",
    "partial-rows-cols": "reshard",
}
FIXED_CASES = {"fixed-reshard": "fixed", "fixed-gather": "fixed", "fixed-tree": "fixed"}


# -- command line ---------------------------------------------------------------------------


def test_defaults() -> None:
    args = run.parse([])
    settings = run.settings_of(args)
    assert (args.reps, args.world, args.sizes, args.only, args.plot, args.quick) == (15, 4, None, [], [], False)
    assert (settings.reps, settings.world, settings.sizes, settings.peers) == (15, 4, None, True)


def test_flags() -> None:
    argv = ["--quick", "--reps", "3", "--world", "3", "--sizes", "1", "2.5", "--no-peers",
            "--only", "gather", "--only", "dim0", "--plot", "a.png", "--out", "o"]  # fmt: skip
    args = run.parse(argv)
    settings = run.settings_of(args)
    assert settings == Settings(quick=True, reps=3, peers=False, world=3, sizes=(1.0, 2.5))
    assert (args.only, args.plot, args.out) == (["gather", "dim0"], [Path("a.png")], Path("o"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reps", "0"], "--reps must be at least 1, got 0"),
        (["--world", "1"], "--world must be at least 2, got 1"),
        (["--sizes", "16", "0"], "--sizes must be positive MiB, got [16.0, 0.0]"),
        (["--reps", "x"], "invalid int value: 'x'"),
    ],
    ids=["reps", "world", "sizes", "not-a-number"],
)
def test_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run.parse(argv)
    assert message in capsys.readouterr().err


def test_settings_json_leaves_progress_out() -> None:
    settings = Settings(sizes=(1.0,), progress=_Recorder())
    assert settings.to_dict() == {**Settings(sizes=(1.0,)).to_dict()}
    assert "progress" not in json.dumps(settings.to_dict())


# -- the case list --------------------------------------------------------------------------


def test_every_issue_case_at_both_default_sizes() -> None:
    assert {s.key: s.kind for s in dist.SCENARIOS} == {**ISSUE_CASES, **FIXED_CASES}
    cases = [c for c in dist.cases(Settings()) if c.key in ISSUE_CASES]
    assert {(c.key, c.mib) for c in cases} == {(k, mib) for k in ISSUE_CASES for mib in (16.0, 256.0)}
    assert all(c.group.startswith("torch_dist: 4 Gloo processes") for c in cases)


def test_fixed_cost_cases_run_once_in_a_group_of_their_own() -> None:
    cases = [c for c in dist.cases(Settings(sizes=(1.0, 2.0))) if c.key in FIXED_CASES]
    assert [(c.key, c.mib) for c in cases] == [(k, dist.FIXED_MIB) for k in FIXED_CASES]
    assert all(c.group.startswith("torch_dist, fixed cost per call: 4 Gloo processes") for c in cases)
    assert [c.name for c in cases] == [
        "per call: reshard 64x64 dim 0 -> dim 1",
        "per call: gather 64x64 to all ranks",
        "per call: reshard a tree of 70 8x4 arrays, Chunk(0) -> Replicated",
    ]
    assert dist.cases(Settings())[0].batch.calls == dist.FIXED_CALLS
    assert dist.cases(Settings(quick=True))[0].batch.calls == dist.QUICK_FIXED_CALLS
    only = run.collect(Settings(quick=True), ["fixed"])
    assert [c.key for c in only] == list(FIXED_CASES)


def test_targets() -> None:
    assert {s.key: s.target for s in dist.SCENARIOS} == {
        **{k: (1.25 if kind == "reshard" else 1.15) for k, kind in ISSUE_CASES.items()},
        **dict.fromkeys(FIXED_CASES),
    }


def test_sizes_world_and_quick() -> None:
    assert {c.mib for c in dist.cases(Settings(quick=True)) if c.key in ISSUE_CASES} == {1.0}
    assert {c.mib for c in dist.cases(Settings(sizes=(2.0, 8.0))) if c.key in ISSUE_CASES} == {2.0, 8.0}
    assert "gather-uneven" not in {c.key for c in dist.cases(Settings(world=2))}
    assert dist.cases(Settings(quick=True, reps=15))[0].batch.reps == 5
    assert dist.cases(Settings(reps=20))[0].batch.reps == 20


def test_collect_has_every_module_and_filters() -> None:
    assert run.CASE_MODULES == (
        "fshard.benchmarks.planner",
        "fshard.benchmarks.local",
        "fshard.benchmarks.autograd",
        "fshard.benchmarks.dist",
        "fshard.benchmarks.training",
        "fshard.benchmarks.imports",
        "fshard.benchmarks.dcp",
        "fshard.benchmarks.hf",
    )
    everything = run.collect(Settings(quick=True))
    assert {c.group.split(":")[0].split(",")[0] for c in everything} >= {
        "planner",
        "local backend",
        "autograd",
        "torch_dist",
        "training",
        "import",
    }
    only = run.collect(Settings(quick=True), ["dim0-dim1"])  # a scenario key
    assert [(c.group.split(":")[0], c.name) for c in only] == [("torch_dist", "reshard dim 0 -> dim 1, 1 MiB")]
    assert run.collect(Settings(quick=True), ["no such case"]) == []


def test_batch_runs_only_the_cases_still_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[tuple[str, float]]] = []

    def fake_run(todo: Any, world: int, reps: int, peers: bool, progress: Any = None,
                 per_round: int = 1) -> list[dict[str, Any]]:  # fmt: skip
        calls.append(list(todo))
        return [_result(key, mib) for key, mib in todo]

    monkeypatch.setattr(dist, "run", fake_run)
    kept = [c for c in dist.cases(Settings(sizes=(1.0,))) if c.key in ("grid-rows", "shard-src0")]
    rows = [r for c in kept for r in c.run(Settings())]
    assert calls == [[("grid-rows", 1.0), ("shard-src0", 1.0)]]  # one launch, the dropped cases left out
    assert {r.case for r in rows} == {"reshard 2-D grid -> rows, 1 MiB", "shard(src=0), dim-0 chunks, 1 MiB"}


# -- combining the ranks' results -----------------------------------------------------------


def _part(rank_times: dict[str, list[float]], sent: int, checks: dict[str, bool | None]) -> dict[str, Any]:
    return {
        "key": "dim0-dim1",
        "mib": 1.0,
        "members": (0, 1),
        "samples": rank_times,
        "cpu": {name: [t / 4 for t in times] for name, times in rank_times.items()},  # the calling thread's
        "checks": checks,
        "sent": sent,
        "memory": dict.fromkeys(rank_times, 2.0),
        "min_elements": 10,
        "floor_elements": 10,
        "unsupported": {"ShardedTensor": "no"},
        "notes": {},
        "floor_op": "all_to_all_single",
        "p2p_op": "isend/irecv",
    }


def test_combine_takes_the_slowest_rank_per_round_then_the_median() -> None:
    a = _part({"floor": [1.0, 2.0, 3.0], "floor p2p": [2.0, 2.0, 2.0], "fshard": [1.0, 5.0, 2.0]}, 4,
              {"floor": None, "floor p2p": None, "fshard": True})  # fmt: skip
    b = _part({"floor": [2.0, 1.0, 1.0], "floor p2p": [2.0, 2.0, 2.0], "fshard": [3.0, 1.0, 1.0]}, 6,
              {"floor": None, "floor p2p": None, "fshard": True})  # fmt: skip
    res = dist.combine([a, None, b])  # None: a rank outside the case's group
    assert res["impls"]["floor"]["samples_s"] == [2.0, 2.0, 3.0]
    assert res["impls"]["fshard"]["samples_s"] == [3.0, 5.0, 2.0]
    assert (res["floor_s"], res["impls"]["fshard"]["ratio"]) == (2.0, 1.5)  # floor: the faster of the two floors
    assert (res["fshard_bytes"], res["min_bytes"], res["bytes_ok"]) == (40, 40, True)
    assert res["ratio_ok"] is False  # 1.5 > 1.25
    assert res["impls"]["fshard"]["verified"] is True
    assert res["impls"]["floor"]["verified"] is None


def test_combine_flags_wrong_results_and_extra_bytes() -> None:
    times = {"floor": [1.0], "fshard": [1.0]}
    res = dist.combine(
        [_part(times, 5, {"floor": None, "fshard": True}), _part(times, 6, {"floor": None, "fshard": False})]
    )
    assert (res["bytes_ok"], res["impls"]["fshard"]["verified"], res["ratio_ok"]) == (False, False, True)
    fshard_row = next(r for r in dist.result_rows(res, "g") if r.impl == "fshard")
    assert (fshard_row.ok, fshard_row.verified, fshard_row.sent_bytes, fshard_row.min_bytes) == (False, False, 44, 40)


def _result(key: str, mib: float, fshard_s: float = 2.0) -> dict[str, Any]:
    times = {"floor": [1.0], "fshard": [fshard_s], "DTensor": [3.0]}
    checks = {"floor": None, "fshard": True, "DTensor": True}
    part = {**_part(times, 10, checks), "key": key, "mib": mib}
    return dist.combine([part])


def test_result_rows() -> None:
    rows = dist.result_rows(_result("grid-rows", 16.0, fshard_s=1.2), "group")
    assert [r.impl for r in rows] == ["floor", "fshard", "ShardedTensor", "DTensor"]
    floor, fshard, st, dt = rows
    assert {r.case for r in rows} == {"reshard 2-D grid -> rows, 16 MiB"}
    assert {(r.series, r.size_mib) for r in rows} == {("reshard 2-D grid -> rows", 16.0)}
    assert (fshard.ratio, fshard.target, fshard.ok, fshard.sent_bytes) == (1.2, "<= 1.25x floor", True, 40)
    assert (st.seconds, st.note) == (None, "N/A: no")
    assert (dt.ratio, dt.ok, dt.verified) == (3.0, True, True)
    assert dt.note == "fshard / DTensor = 0.40x"
    assert floor.note == "all_to_all_single"


def test_the_pack_a2a_reference_row_gives_fshards_ratio_to_it() -> None:
    times = {"floor": [1.0], "pack+a2a": [2.0], "fshard": [2.1]}
    part = {**_part(times, 10, {"floor": None, "pack+a2a": True, "fshard": True}), "key": "dim0-dim1"}
    res = dist.combine([part])
    assert res["ref_ratio"] == pytest.approx(1.05)
    rows = {r.impl: r for r in dist.result_rows(res, "g")}
    ref = rows["pack+a2a"]
    assert (ref.ratio, ref.target, ref.ok, ref.verified) == (2.0, "fshard <= 1.10x", True, True)
    assert ref.note.startswith("fshard / pack+a2a = 1.05x")
    assert rows["fshard"].ratio == pytest.approx(2.1)  # still against the floor


def test_a_fixed_cost_row_reports_the_difference_in_microseconds() -> None:
    times = {"floor": [100e-6, 120e-6], "fshard": [250e-6, 260e-6]}
    part = {**_part(times, 10, {"floor": None, "fshard": True}), "key": "fixed-reshard", "mib": dist.FIXED_MIB}
    res = dist.combine([part])
    rows = {r.impl: r for r in dist.result_rows(res, "g")}
    assert rows["fshard"].note == "fshard - floor = 145 µs per call; calling thread's CPU +36 µs"
    assert (rows["fshard"].target, rows["fshard"].ok, rows["fshard"].size_mib) == ("", None, None)
    assert rows["fshard"].case == "per call: reshard 64x64 dim 0 -> dim 1"


def test_the_tree_row_gives_its_ratio_to_one_leaf_against_the_target() -> None:
    times = {"floor": [100e-6], "fshard": [300e-6], "one leaf": [200e-6]}
    part = {**_part(times, 10, dict.fromkeys(times)), "key": "fixed-tree", "mib": dist.FIXED_MIB}
    part["notes"] = {"one leaf": "one array"}
    res = dist.combine([part])
    assert res["leaf_ratio"] == pytest.approx(1.5)
    rows = {r.impl: r for r in dist.result_rows(res, "g")}
    assert rows["fshard"].note.endswith("; tree / one leaf = 1.50x")
    assert (rows["fshard"].target, rows["fshard"].ok) == ("<= 2.00x one leaf", True)
    assert (rows["one leaf"].ratio, rows["one leaf"].target, rows["one leaf"].note) == (2.0, "", "one array")


def test_a_fixed_cost_row_without_cpu_times_gives_the_wall_difference_only() -> None:
    """Results saved before the CPU times were recorded still render."""
    times = {"floor": [100e-6, 120e-6], "fshard": [250e-6, 260e-6]}
    part = {**_part(times, 10, {"floor": None, "fshard": True}), "key": "fixed-reshard", "mib": dist.FIXED_MIB}
    del part["cpu"]
    rows = {r.impl: r for r in dist.result_rows(dist.combine([part]), "g")}
    assert rows["fshard"].note == "fshard - floor = 145 µs per call"


def test_a_diagnostic_row_has_no_target() -> None:
    times = {"floor": [1.0], "fshard": [1.1], "all_to_all": [0.5]}
    part = {**_part(times, 10, dict.fromkeys(times)), "key": "partial-chunk", "notes": {"all_to_all": "no sums"}}
    rows = {r.impl: r for r in dist.result_rows(dist.combine([part]), "g")}
    assert (rows["all_to_all"].ratio, rows["all_to_all"].target, rows["all_to_all"].ok) == (0.5, "", None)
    assert rows["all_to_all"].note == "no sums"
    assert (rows["fshard"].target, rows["fshard"].ok) == ("<= 1.15x floor", True)  # a reduction's target


# -- table, JSON, plot ------------------------------------------------------------------------


def _rows() -> list[Row]:
    rows = dist.result_rows(_result("dim0-dim1", 16.0), "torch_dist: test")
    rows += dist.result_rows(_result("dim0-dim1", 256.0, fshard_s=1.1), "torch_dist: test")
    rows.append(Row("planner", "validate grid", "fshard Layout()", 0.05, 15, target="< 0.1 s", ok=True))
    rows.append(Row("planner", "broken", "error", None, note="ValueError: boom"))
    return rows


INFO = {"cpu": "Test CPU", "cores": 2, "memory_gib": 4.0, "torch": "2.x", "python": "3.x", "load_before": "0.0"}


def test_table_text() -> None:
    pytest.importorskip("rich")
    text = report.table_text(_rows(), INFO)
    assert "fshard bench on Test CPU (2 cores, 4.0 GiB)" in text
    assert "MiB sent / min" in text  # the torch_dist group has bytes...
    assert "0.0 / 0.0 ✓" in text
    assert "reshard dim 0 -> dim 1, 256 MiB" in text
    assert "<= 1.25x floor ✗" in text  # 2.0x at 16 MiB
    planner = text[text.index("planner") :]
    assert "MiB sent" not in planner  # ...the planner group does not
    assert "ValueError: boom" in planner


def test_markdown() -> None:
    rows = _rows()
    big = rows[4]  # the 256 MiB case: floor, fshard, ShardedTensor, DTensor
    copies = Row(big.group, big.case, "copies", 0.5, 1, 0.5, "x floor", series=big.series, size_mib=big.size_mib)
    rows.insert(6, copies)
    dist_table, planner_table = report.markdown(rows).split("**planner**")
    lines = dist_table.splitlines()
    assert lines[0] == "**torch_dist: test**"
    head = "| case | MiB | floor ms | fshard ms | copies ms | ShardedTensor ms | DTensor ms | sent / min MiB |"
    assert lines[2].startswith(head)  # copies right after fshard, as in the case that has it
    assert lines[4].startswith("| reshard dim 0 -> dim 1 | 16 | 1000.00 (1.00x) | 2000.00 (2.00x) |  | N/A |")
    assert lines[4].endswith("| 0.0 / 0.0 ✓ | 2 | <= 1.25x floor ✗ | ✓ |")
    assert lines[5].startswith("| reshard dim 0 -> dim 1 | 256 | 1000.00 (1.00x) | 1100.00 (1.10x) | 500.00 (0.50x) |")
    assert "| validate grid | fshard Layout() | 50.00 ms |  | < 0.1 s ✓ |  |" in planner_table


def test_markdown_gives_fshards_ratio_to_the_pack_a2a_reference() -> None:
    times = {"floor": [1.0], "pack+a2a": [2.0], "fshard": [2.4]}
    part = {**_part(times, 10, {"floor": None, "pack+a2a": True, "fshard": True}), "key": "dim0-dim1"}
    lines = report.markdown(dist.result_rows(dist.combine([part]), "g")).splitlines()
    assert "| pack+a2a ms | fshard ms | ShardedTensor ms | fshard / pack+a2a | sent / min MiB |" in lines[2]
    assert lines[4].endswith(
        "| 2000.00 (2.00x) | 2400.00 (2.40x) | N/A | 1.20x ✗ | 0.0 / 0.0 ✓ | 2 | <= 1.25x floor ✗ | ✓ |"
    )


def test_json_round_trip(tmp_path: Path) -> None:
    rows = _rows()
    path = report.save(rows, INFO, Settings(sizes=(16.0,)), tmp_path / "sub" / "b.json", 12.5)
    data = json.loads(path.read_text())
    assert (data["wall_s"], data["settings"]["sizes"], data["machine"]["cpu"]) == (12.5, [16.0], "Test CPU")
    assert report.load_rows(path) == rows


def test_plot_series_and_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    series = report.plot_series(_rows())
    assert list(series) == [("torch_dist: test", "reshard dim 0 -> dim 1")]
    assert series[("torch_dist: test", "reshard dim 0 -> dim 1")]["fshard"] == [(16.0, 2.0), (256.0, 1.1)]
    paths = [tmp_path / "a.png", tmp_path / "docs" / "b.png"]
    assert report.plot(_rows(), paths, "title") == paths
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
    assert report.plot([r for r in _rows() if r.group == "planner"], paths) == []  # no sizes: nothing to plot


def test_rows_with_an_x_of_their_own_plot_against_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        Row("planner", f"grid -> rows, {n} ranks", "cached re-plan", 1e-6 * n, series="planning", x=n, x_label="ranks")
        for n in (64.0, 1024.0)
    ]
    assert report.plot_series(rows) == {("planner", "planning"): {"cached re-plan": [(64.0, 64e-6), (1024.0, 1024e-6)]}}
    assert report.plot(rows, [tmp_path / "ranks.png"]) == [tmp_path / "ranks.png"]


def test_render_saved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("rich")
    path = report.save(_rows(), INFO, Settings(), tmp_path / "b.json", 1.0)
    assert run.main(["--render", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    assert "reshard dim 0 -> dim 1, 16 MiB" in capsys.readouterr().out
    assert (tmp_path / "p.png").exists()


def test_render_of_no_results_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    for name in ("missing.json", "text.json", "empty.json", "binary.json", "."):
        path = tmp_path / name
        assert run.main(["--render", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"fshard bench --render: {path} is not a results file that bench saved" in err, name
        assert "Traceback" not in err


def test_render_says_when_it_draws_no_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("rich")
    unsized = [Row("training", "GPT d_model 128", "fshard DP", 0.03)]
    path = report.save(unsized, INFO, Settings(), tmp_path / "b.json", 1.0)
    assert run.main(["--render", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    assert "plot: none written" in capsys.readouterr().out
    assert not (tmp_path / "p.png").exists()


# -- running cases --------------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def start(self, label: str) -> None:
        self.events.append(f"start {label}")

    def done(self) -> None:
        self.events.append("done")


class _Fake:
    group = "fake"

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail

    def run(self, settings: Settings) -> list[Row]:
        if self.fail:
            raise ValueError("boom")
        assert settings.progress is not None
        return [Row(self.group, self.name, "fshard", 1.0, 1)]


def test_run_cases_reports_a_failing_case_and_goes_on() -> None:
    rows = run.run_cases([_Fake("a"), _Fake("b", fail=True), _Fake("c")], Settings())
    assert [(r.case, r.impl, r.note) for r in rows] == [("a", "fshard", ""), ("b", "error", "ValueError: boom"),
                                                         ("c", "fshard", "")]  # fmt: skip


def test_tiny_real_run() -> None:
    """Two Gloo processes, six cases at 16 KiB (the tree: 70 8x4 arrays): results verified, bytes sent == minimum."""
    progress = _Recorder()
    todo = [("dim0-dim1", 1 / 64), ("gather-one", 1 / 64), ("partial-repl", 1 / 64), ("partial-rows-cols", 1 / 64),
            ("fixed-reshard", dist.FIXED_MIB), ("fixed-tree", dist.FIXED_MIB)]  # fmt: skip
    results = dist.run(todo, world=2, reps=1, peers=False, progress=progress, calls=2)
    assert [(r["key"], r["mib"]) for r in results] == todo
    for res in results:
        assert res["bytes_ok"], (res["fshard_bytes"], res["min_bytes"])
        assert res["min_bytes"] > 0
        assert res["impls"]["fshard"]["verified"] is True
        assert len(res["impls"]["fshard"]["samples_s"]) == 1
    numel = 64 * 64  # 16 KiB of float32
    assert results[2]["min_bytes"] == 2 * (2 - 1) * numel * 4  # the all-reduce's stated bound, 2(n-1)N
    assert results[2]["impls"]["floor"]["verified"] is True  # dist.all_reduce gave the same sum
    assert "all_to_all" in results[2]["impls"]
    assert "reduce on the owners + parts to all" in results[2]["notes"]["fshard"]  # the local order, on Gloo
    assert "packed all_to_all" in results[3]["notes"]["fshard"]
    assert results[0]["impls"]["pack+a2a"]["verified"] is True  # the hand-packed reference's result
    assert results[4]["impls"]["floor"]["samples_s"][0] > 0
    tree = results[5]
    assert tree["min_bytes"] == 70 * 2 * (8 * 4 // 2) * 4  # each of 2 ranks receives the half of each array it lacks
    assert tree["impls"]["one leaf"]["verified"] is True
    assert tree["leaf_ratio"] > 0
    assert progress.events[:4] == ["start reshard dim 0 -> dim 1, 0.015625 MiB", "done",
                                   "start gather to rank 0, even chunks, 0.015625 MiB", "done"]  # fmt: skip
    assert progress.events[4:8] == ["start Partial(Replicated) -> Replicated, 0.015625 MiB", "done",
                                    "start Partial(rows, sum over y) -> Chunk(1), 0.015625 MiB", "done"]  # fmt: skip
    tree_case = "start per call: reshard a tree of 70 8x4 arrays, Chunk(0) -> Replicated"
    assert progress.events[8:] == ["start per call: reshard 64x64 dim 0 -> dim 1", "done", tree_case, "done"]


def test_the_training_case_times_every_program_and_counts_fshards_movements() -> None:
    from fshard.benchmarks import training

    rows = training.TrainingCase(16).run(Settings(reps=1, world=2, quick=True))
    assert [r.impl for r in rows] == ["fshard DP", "DDP", "fshard FSDP", "fshard FSDP (per block)", "FSDP2"]
    assert all(r.seconds is not None and r.seconds > 0 for r in rows)
    assert all(r.peak_mib is not None and r.peak_mib > 0 for r in rows)
    dp, fsdp, per_block = rows[0], rows[2], rows[3]
    assert (dp.ratio_to, fsdp.ratio_to, per_block.ratio_to) == ("DDP", "FSDP2", "FSDP2")
    model = training.GPT(16)
    params = sum(p.numel() for p in model.parameters())
    kept = sum(p.numel() for m in (model.wte, model.wpe, model.ln, model.head) for p in m.parameters())
    # Each rank sends half of every gradient (the all-reduce bound on 2 ranks), and for FSDP
    # half of every parameter and half of every gradient; the busiest rank also sends the loss's element.
    # Data parallel's last bucket carries more: the loss (fshard.backward), the count of late gradients, and
    # each parameter's uses (a parameter no rank used gets no gradient).
    assert dp.sent_bytes == 4 * (params + 2 + len(list(model.parameters())))
    assert fsdp.sent_bytes == 4 * (params + 1)
    # Per block, half of the blocks' parameters again in the backward (the embeddings' backward needs
    # no weights; the last stage keeps its copy).
    assert per_block.sent_bytes == 4 * (params + (params - kept) // 2 + 1)


def test_the_tp_training_case_times_both_programs_and_counts_fshards_movements() -> None:
    from fshard.benchmarks import training

    rows = training.TPTrainingCase(16).run(Settings(reps=1, world=2, quick=True))
    assert [r.impl for r in rows] == ["fshard TP+DP", "TP+DDP"]
    assert all(r.seconds is not None and r.seconds > 0 for r in rows)
    assert rows[0].ratio_to == "TP+DDP"
    # dp=1, tp=2: four all-reduces over tp per block of 8 x 32 x 16 activations (each rank sends
    # half of each, twice), the gradients of the 9,120 replicated parameters summed over their two
    # copies (their last bucket carrying more elements: the count of late gradients, a value that
    # fshard.backward would carry, and each of the 29 replicated tensors' uses), and the loss's element.
    # Each forward psum also sums 4 counts (of the ranks whose summand records a gradient, or has a tangent).
    activations = 4 * training.BLOCKS * training.BATCH * training.SEQ * 16
    replicated = 4096 + 512 + training.BLOCKS * (4 * 16 + 2 * 16) + 2 * 16 + 4096
    tensors = 2 + training.BLOCKS * 6 + 3  # wte, wpe; per block two norms' weights and biases, two biases; ln, head
    counts = 4 * 2 * training.BLOCKS
    assert rows[0].sent_bytes == 4 * (activations + replicated + 2 + tensors + 1 + counts)
    assert rows[0].min_bytes == 4 * activations
    assert "19 collectives per step" in rows[0].note  # 16 psums, the loss, its exchange of outcomes, one bucket


# -- Hugging Face checkpoints ------------------------------------------------------------------


def test_hf_cases_three_per_size() -> None:
    from fshard.benchmarks import hf

    cases = hf.cases(Settings(sizes=(8.0, 32.0)))
    assert [c.name for c in cases] == [
        f"{what}, {mib} MiB"
        for mib in (8, 32)
        for what in ("folder -> Chunk(0)", "folder -> Replicated", "save_safetensors")
    ]
    assert {c.group for c in cases} == {"checkpoint: Hugging Face safetensors, 4 Gloo processes"}
    assert hf.cases(Settings(quick=True))[0].name == "folder -> Chunk(0), 16 MiB"


def test_hf_cases_run_on_two_processes() -> None:
    from fshard.benchmarks import hf

    rows = [r for c in hf.cases(Settings(sizes=(1.0,), reps=1, world=2)) for r in c.run(Settings())]
    fshard_rows = [r for r in rows if r.impl.startswith("fshard")]
    assert [r.impl for r in fshard_rows] == [
        "fshard.load -> Chunk(0)",
        "fshard.load -> Replicated",
        "fshard.save_safetensors",
    ]
    assert all(r.verified for r in fshard_rows)
    assert "disk bytes read 1.0 MiB = 1.000x distinct boxes" in fshard_rows[0].note
    assert "disk bytes read 1.0 MiB = 1.000x one copy" in fshard_rows[1].note
    assert "2 files, one per rank" in fshard_rows[2].note


def test_the_import_case_gives_what_fshard_adds_to_torch_against_its_target() -> None:
    from fshard.benchmarks import imports

    added, alone = imports.ImportCase().run(Settings(quick=True))
    assert (added.impl, alone.impl) == ("import fshard (added)", "import torch")
    assert added.reps == alone.reps == 3
    assert len(added.samples) == len(alone.samples) == 3
    assert added.target == "<= +0.2 s and +10 MiB"
    assert added.ok is (added.seconds <= 0.2 and added.peak_mib <= 10.0)
    assert alone.seconds > added.seconds > 0  # torch itself costs more than what fshard adds


def test_an_out_that_is_a_file_is_refused_before_the_run(tmp_path, capsys) -> None:
    """Before, the run went on to its end and lost its results to a FileExistsError."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        run.parse(["--out", str(tmp_path / "f")])
    assert exit_.value.code == 2
    assert f"--out is a folder for the results, and {tmp_path / 'f'} is a file" in capsys.readouterr().err
