"""Checkpoints on the local backend: round trips across layouts and world sizes, damage, crashes."""

from __future__ import annotations

import collections
import enum
import json
import os
import re
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import fshard
from fshard._checkpoint import _reader, _write
from fshard._checkpoint._format import index_digest

SHAPE = (10, 12)
ALL = [0, 1, 2, 3]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    a = fshard.gather(a) if isinstance(a, fshard.ShardedArray) else a
    b = fshard.gather(b) if isinstance(b, fshard.ShardedArray) else b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _data(shape=SHAPE, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x.view(-1)[0] = float("nan")  # bit-identical, not merely equal
    return x.to(dtype)


def _files(root: Path) -> dict[str, Path]:
    index = json.loads((root / "index.json").read_text())
    return {p.name: p for p in (root / index["data"]).iterdir()}


SAVED = {
    "rows-on-4": fshard.Chunk(0, ALL),
    "grid-2x2": fshard.Named(fshard.Mesh((2, 2)), ("x", "y")),
    "rows+replicas": fshard.Named(fshard.Mesh((2, 2)), (None, "y")),
    "uneven-on-4": fshard.Explicit(
        [((0, 0), (7, 5), 3), ((0, 5), (7, 7), 1), ((7, 0), (3, 12), 0), ((7, 0), (3, 12), 2)]
    ),
}
TARGETS = {
    "1-rank": fshard.Single(0),
    "2-ranks-cols": fshard.Chunk(1, [0, 1]),
    "3-ranks-rows": fshard.Chunk(0, [2, 0, 1]),
    "3-ranks-grid": fshard.Explicit([((0, 0), (4, 12), 0), ((4, 0), (6, 5), 1), ((4, 5), (6, 7), 2)]),
    "2-ranks-replicated": fshard.Replicated([0, 1]),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("source", sorted(SAVED))
def test_save_on_four_ranks_load_on_fewer_is_bit_identical(tmp_path, source, target):
    x = fshard.shard(_data(), SAVED[source])
    fshard.save(tmp_path, {"x": x})
    for verify in (True, False):
        y = fshard.load(tmp_path, specs={"x": TARGETS[target]}, verify=verify)["x"]
        assert y.layout == TARGETS[target].layout(SHAPE)
        assert _same(x, y)


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool],
)
def test_dtypes_round_trip(tmp_path, dtype):
    full = (_data() * 50).to(dtype) if dtype != torch.bool else _data() > 0
    x = fshard.shard(full, fshard.Chunk(1, [0, 1, 2]))
    fshard.save(tmp_path, {"x": x, "t": full[:3]})
    out = fshard.load(tmp_path, specs={"x": fshard.Chunk(0, [1, 0]), "t": None})
    assert out["x"].dtype == dtype
    assert _same(out["x"], x)
    assert _same(out["t"], full[:3])


def test_tree_of_scalars_tensors_and_containers_round_trips(tmp_path):
    x = fshard.shard(_data(), fshard.Chunk(0, ALL))
    tree = {
        "model": collections.OrderedDict(w=x, b=torch.arange(5.0)),
        3: [1, 2.5, float("inf"), float("nan"), True, None, "adam", (torch.tensor(7), ())],
        "empty": {},
    }
    fshard.save(tmp_path, tree)
    out = fshard.load(tmp_path)
    assert list(out) == ["model", 3, "empty"]
    assert type(out["model"]) is dict
    assert out["empty"] == {}
    assert _same(out["model"]["w"], x)
    assert out["model"]["w"].layout == x.layout
    assert torch.equal(out["model"]["b"], torch.arange(5.0))
    scalars = out[3]
    assert scalars[:3] == [1, 2.5, float("inf")]
    assert scalars[3] != scalars[3]
    assert scalars[4:7] == [True, None, "adam"]
    assert type(scalars[4]) is bool
    assert type(scalars[7]) is tuple
    assert torch.equal(scalars[7][0], torch.tensor(7))
    assert scalars[7][1] == ()


def test_a_single_array_as_the_whole_tree(tmp_path):
    x = fshard.shard(_data(), fshard.Chunk(0, ALL))
    fshard.save(tmp_path, x)
    assert _same(fshard.load(tmp_path, specs=fshard.Chunk(1, [0, 1])), x)


def test_load_like_a_tree_gives_its_layouts_devices_and_requires_grad(tmp_path):
    x = fshard.shard(_data(), fshard.Chunk(0, ALL))
    fshard.save(tmp_path, {"x": x, "t": torch.ones(3), "n": 4})
    like = {
        "x": fshard.zeros(fshard.Chunk(1, [1, 2]), *SHAPE, requires_grad=True),
        "t": torch.zeros(3, requires_grad=True),
        "n": 0,
    }
    out = fshard.load(tmp_path, like=like)
    assert out["x"].layout == like["x"].layout
    assert out["x"].requires_grad
    assert _same(out["x"], x)
    assert out["t"].requires_grad
    assert torch.equal(out["t"], torch.ones(3))
    assert out["n"] == 4


def test_a_spec_covers_a_subtree_and_plain_tensors_reshard(tmp_path):
    full = _data()
    fshard.save(tmp_path, {"a": full, "b": [fshard.shard(full, fshard.Single(3)), "tag"]})
    spec = fshard.Chunk(0, [0, 1])
    out = fshard.load(tmp_path, specs={"a": spec, "b": spec})
    assert out["a"].layout == out["b"][0].layout == spec.layout(SHAPE)
    assert out["b"][1] == "tag"
    assert _same(out["a"], full)
    assert _same(out["b"][0], full)
    assert _same(fshard.load(tmp_path, specs=None)["b"][0], full)


def test_empty_shards_zero_size_arrays_and_zero_d_tensors(tmp_path):
    x = fshard.shard(torch.arange(2.0), fshard.Chunk(0, ALL))  # ranks 2 and 3 hold empty shards
    z = fshard.zeros(fshard.Chunk(0, [0, 1]), 0, 3)
    fshard.save(tmp_path, {"x": x, "z": z, "s": torch.tensor(2.5)})
    out = fshard.load(tmp_path, specs={"x": fshard.Chunk(0, [0, 1, 2]), "z": fshard.Chunk(1, [0, 1]), "s": None})
    assert _same(out["x"], x)
    assert tuple(out["z"].shape) == (0, 3)
    assert out["s"].item() == 2.5


def test_each_box_written_once_and_replicas_balance_bytes(tmp_path):
    arrays = {f"w{k}": fshard.shard(_data((8, 8), seed=k), fshard.Replicated(ALL)) for k in range(8)}
    fshard.save(tmp_path, arrays)
    files = _files(tmp_path)
    names = []
    for path in files.values():
        with safe_open(str(path), "pt") as f:
            names += list(f.keys())
    assert sorted(names) == sorted(f"[{k!r}]@0:8,0:8" for k in arrays)
    sizes = [p.stat().st_size for p in files.values()]
    assert len(sizes) == 4
    assert max(sizes) - min(sizes) < 8 * 8 * 4


def test_shared_memory_and_repeated_leaves_are_saved(tmp_path):
    t = torch.arange(6.0)
    x = fshard.shard(t, fshard.Chunk(0, [0]))
    fshard.save(tmp_path, {"a": t, "b": t, "c": t[2:], "x": x, "y": x})
    out = fshard.load(tmp_path)
    assert torch.equal(out["c"], t[2:])
    assert _same(out["y"], t)


def test_load_reads_only_overlapping_ranges_without_verify(tmp_path, monkeypatch):
    x = fshard.shard(_data((40, 10)), fshard.Chunk(0, ALL))
    fshard.save(tmp_path, x)
    read, whole = [], []
    part, full = _reader.Reader.part, _reader.Reader.whole
    monkeypatch.setattr(_reader.Reader, "part", lambda self, *a: read.append(t := part(self, *a)) or t)
    monkeypatch.setattr(_reader.Reader, "whole", lambda self, *a: whole.append(t := full(self, *a)) or t)
    target = fshard.Explicit([((5, 0), (12, 10), 0), ((0, 0), (5, 10), 1), ((17, 0), (23, 10), 1)])
    assert _same(fshard.load(tmp_path, specs=target, verify=False), x)
    assert sum(t.numel() for t in read) == 400
    assert not whole
    read.clear()
    narrow = fshard.Explicit([((0, 0), (1, 10), 0), ((1, 0), (39, 10), 1)])
    fshard.load(tmp_path, specs=narrow, verify=True)  # a hash needs the whole box: all four, once each
    assert not read
    assert sorted(t.shape[0] for t in whole) == [10, 10, 10, 10]


# -- damage --------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    x = fshard.shard(_data(), fshard.Chunk(0, ALL))
    fshard.save(tmp_path, {"x": x, "step": 3})
    return tmp_path, x


def test_a_flipped_byte_is_caught_naming_file_and_tensor(saved):
    root, x = saved
    path = _files(root)["rank-00002.safetensors"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(fshard.CheckpointError, match=r"rank-00002\.safetensors: tensor \"\['x'\]@6:9,0:12\".*sha256"):
        fshard.load(root)
    assert not _same(fshard.load(root, verify=False)["x"], x)  # verify=False trusts the bytes


def test_a_truncated_file_is_caught(saved):
    root, _ = saved
    path = _files(root)["rank-00001.safetensors"]
    os.truncate(path, path.stat().st_size - 7)
    truncated = r"^Checkpoint file [^:]*rank-00001\.safetensors has \d+ bytes.*truncated.*\['x'\]@3:6"
    with pytest.raises(fshard.CheckpointError, match=truncated) as e:
        fshard.load(root, verify=False)
    assert str(e.value).count("Checkpoint file") == 1  # said once, not wrapped in a second message


def test_a_missing_file_is_caught(saved):
    root, _ = saved
    _files(root)["rank-00003.safetensors"].unlink()
    with pytest.raises(fshard.CheckpointError, match=r"rank-00003\.safetensors is missing.*\['x'\]@9:10,0:12"):
        fshard.load(root)


def test_a_file_from_elsewhere_is_caught(saved):
    root, _ = saved
    path = _files(root)["rank-00000.safetensors"]
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k).view(torch.int32) for k in f.keys()}  # noqa: SIM118 (not iterable)
    save_file(tensors, str(path), metadata={"format": "fshard-checkpoint", "rank": "0"})
    with pytest.raises(fshard.CheckpointError, match=r"rank-00000\.safetensors: tensor .* is I32 .* records F32"):
        fshard.load(root)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda root: (root / "index.json").unlink(), "index.json does not exist"),
        (lambda root: (root / "index.json").write_text("{"), "is not valid JSON"),
        (lambda root: _edit_index(root, version=99), "format version 99"),
        (lambda root: _edit_index(root, data="../elsewhere"), "names data directory"),
        (lambda root: _edit_index(root, leaves=[]), r"malformed: tree\.dict\[0\]\[1\]\.leaf names a leaf"),
        (lambda root: _edit_index(root, redigest=False, leaves=[]), "does not match its digest"),
    ],
    ids=["no-index", "bad-json", "version", "data-dir", "leaves", "leaves-without-digest"],
)
def test_a_damaged_index_is_caught(saved, edit, message):
    root, _ = saved
    edit(root)
    with pytest.raises(fshard.CheckpointError, match=message):
        fshard.load(root)


def _edit_index(root: Path, redigest: bool = True, **changes) -> None:
    """Changes top-level keys of the index; ``redigest`` updates its digest, as a deliberate writer would."""
    index = json.loads((root / "index.json").read_text()) | changes
    if redigest:
        index["digest"] = index_digest(index)
    (root / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("like", "message"),
    [
        ({"x": torch.zeros(SHAPE)}, r"at the root: the checkpoint has keys \['x', 'step'\].*missing \['step'\]"),
        ([torch.zeros(SHAPE), 3], "the checkpoint has a dict with keys"),
        ({"x": torch.zeros(SHAPE), "step": 3, "lr": 0.1}, r"extra \['lr'\]"),
        ({"x": torch.zeros(10, 11), "step": 3}, r"Leaf \['x'\].*shape \(10, 12\).*`like` has shape \(10, 11\)"),
        ({"x": torch.zeros(SHAPE, dtype=torch.float64), "step": 3}, r"dtype torch.float32.*dtype torch.float64"),
        ({"x": torch.zeros(SHAPE), "step": "3"}, r"Leaf \['step'\].*is the int 3, `like` has a str"),
        ({"x": torch.zeros(SHAPE), "step": True}, r"Leaf \['step'\].*is the int 3, `like` has a bool"),
        ({"x": 1, "step": 3}, r"Leaf \['x'\].*is a tensor.*`like` has a int"),
        ({"x": [torch.zeros(SHAPE)], "step": 3}, r"Leaf \[.x.\] of the checkpoint is a tensor.*`like` has a list"),
    ],
    ids=["missing-key", "container", "extra-key", "shape", "dtype", "scalar-type", "bool", "leaf-kind", "deeper"],
)
def test_a_tree_that_does_not_match_is_caught(saved, like, message):
    root, _ = saved
    with pytest.raises(fshard.CheckpointError, match=message):
        fshard.load(root, like=like)


def test_an_int_and_a_float_stand_for_each_other_in_like(saved):
    """As torch's Optimizer.load_state_dict takes weight_decay=0 into an optimizer made with 1e-5."""
    root, _ = saved
    got = fshard.load(root, like={"x": torch.zeros(SHAPE), "step": 0.5})
    assert got["step"] == 3
    assert type(got["step"]) is int  # the saved value, as saved


# -- crashes and replacing checkpoints -----------------------------------------------------


class Crash(RuntimeError):
    pass


def _crash_on_call(monkeypatch, target, name, at):
    calls = []
    real = getattr(target, name)

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise Crash(f"injected crash in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)


@pytest.mark.parametrize(
    ("target", "name", "at"),
    [(_write, "save_file", 3), (_write, "fsync", 2), (_write.os, "replace", 1)],
    ids=["writing-files", "after-a-file", "renaming-index"],
)
def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(saved, monkeypatch, target, name, at):
    root, x = saved
    _crash_on_call(monkeypatch, target, name, at)
    with pytest.raises(Crash):
        fshard.save(root, {"x": fshard.map_local(lambda t: t + 1, x), "step": 4})
    monkeypatch.undo()
    out = fshard.load(root)
    assert _same(out["x"], x)
    assert out["step"] == 3
    assert sorted(p.name.split(".")[0] for p in root.iterdir()) == ["data", "index"]


def test_leftovers_of_a_killed_save_are_ignored_then_removed(saved):
    root, x = saved
    stale = root / ("data." + "f" * 32)
    stale.mkdir()
    (stale / "rank-00000.safetensors").write_bytes(b"half")
    (root / f"index.json.{'e' * 32}.tmp").write_text("{")
    assert _same(fshard.load(root)["x"], x)
    fshard.save(root, {"x": x, "step": 5})
    assert sorted(p.name.split(".")[0] for p in root.iterdir()) == ["data", "index"]
    assert fshard.load(root)["step"] == 5


def test_a_first_save_that_crashes_leaves_no_checkpoint(tmp_path, monkeypatch):
    _crash_on_call(monkeypatch, _write, "save_file", 1)
    with pytest.raises(Crash):
        fshard.save(tmp_path / "ck", {"t": torch.ones(2)})
    monkeypatch.undo()
    with pytest.raises(fshard.CheckpointError, match=r"index.json does not exist \(an interrupted fshard save"):
        fshard.load(tmp_path / "ck")


def test_saving_over_a_checkpoint_replaces_it(saved):
    root, _ = saved
    fshard.save(root, [torch.zeros(2)])
    out = fshard.load(root)
    assert isinstance(out, list)
    assert torch.equal(out[0], torch.zeros(2))
    assert len(_files(root)) == 1


def test_refuses_a_file_or_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(fshard.CheckpointError, match=r"non-empty directory without index.json.*notes.txt"):
        fshard.save(tmp_path, {"t": torch.ones(1)})
    with pytest.raises(fshard.CheckpointError, match="exists and is not a directory"):
        fshard.save(tmp_path / "notes.txt", {"t": torch.ones(1)})
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("tree", "error", "message"),
    [
        ({"f": print}, TypeError, r"builtin_function_or_method at \['f'\] cannot be saved"),
        ({(1, 2): 3}, TypeError, r"Dict key \(1, 2\) at the root is a tuple"),
        ({"p": collections.namedtuple("P", "a")(1)}, TypeError, r"P at \['p'\] is not a plain dict.*_asdict"),
        ({"c": torch.zeros(2, dtype=torch.complex128)}, TypeError, r"dtype torch.complex128"),
        ({"s": torch.zeros(2).to_sparse()}, TypeError, r"layout torch.sparse_coo"),
    ],
    ids=["function", "tuple-key", "namedtuple", "complex128", "sparse"],
)
def test_unsavable_trees_are_refused_before_writing(tmp_path, tree, error, message):
    with pytest.raises(error, match=message):
        fshard.save(tmp_path / "ck", tree)
    assert not (tmp_path / "ck").exists()


def test_a_nested_tensor_is_refused_before_writing(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match=r"Tensor at \['n'\] is a nested tensor; checkpoints take dense tensors"):
        fshard.save(tmp_path / "ck", {"n": nested})
    with pytest.raises(TypeError, match=r"tensor at 'n' that is a nested tensor; checkpoints take dense tensors"):
        fshard.save_safetensors(tmp_path / "hf", {"n": nested})
    assert list(tmp_path.iterdir()) == []


class _Mode(enum.IntEnum):
    A = 3


class _Name(str, enum.Enum):
    X = "x"


class _Loud(str):
    def __str__(self) -> str:
        return "LOUD"


def test_a_subclass_of_a_scalar_type_is_saved_as_its_plain_value(tmp_path):
    """numpy.float64 (a float), an IntEnum member, a str enum: saved and loaded as float, int, str, exactly."""
    root = tmp_path / "ck"
    fshard.save(root, {"lr": 0.1})
    tree = {"lr": np.float64(0.05), "mode": _Mode.A, "name": _Name.X, "loud": _Loud("quiet"), "big": np.float64(1e300)}
    fshard.save(root, tree)  # over a good checkpoint: the new one loads
    out = fshard.load(root)
    assert out == {"lr": 0.05, "mode": 3, "name": "x", "loud": "quiet", "big": 1e300}
    assert [type(v) for v in out.values()] == [float, int, str, str, float]
    assert fshard.checkpoint_info(root)  # the index reads as any other
    with pytest.raises(TypeError, match=r"int64 at \['step'\] cannot be saved"):
        fshard.save(root, {"step": np.int64(7)})  # not an int: refused before writing
    assert fshard.load(root) == out


def test_the_index_file_itself_is_refused_naming_its_folder(saved):
    root, _ = saved
    with pytest.raises(fshard.CheckpointError, match=r"is the index of the checkpoint in .*: pass that folder"):
        fshard.load(root / "index.json")


def test_load_takes_like_or_specs_not_both(saved):
    root, _ = saved
    with pytest.raises(TypeError, match="like= or specs=, not both"):
        fshard.load(root, like={"x": 1, "step": 1}, specs={"x": None, "step": None})


# -- info, progress, module helpers ----------------------------------------------------------


def test_checkpoint_info_shows_tree_shapes_dtypes_and_layouts(saved):
    root, _ = saved
    text = fshard.checkpoint_info(root)
    assert f"fshard checkpoint {root} (format 2): 2 leaves" in text
    assert "['x']: array float32 (10, 12), 4 boxes written" in text
    assert "['step']: int = 3" in text
    assert re.search(r"\|\s+r3\s+\|", text)
    assert "rank-00003.safetensors" in text


def test_progress_bar_only_when_asked_or_big_on_a_terminal(tmp_path, capsys):
    pytest.importorskip("tqdm")
    fshard.save(tmp_path / "a", {"t": torch.ones(4)})
    fshard.load(tmp_path / "a")
    assert capsys.readouterr().err == ""
    fshard.save(tmp_path / "b", {"t": torch.ones(4)}, progress=True)
    fshard.load(tmp_path / "b", progress=True)
    err = capsys.readouterr().err
    assert "fshard.save" in err
    assert "fshard.load" in err


def test_shard_params_is_pure_and_load_state_dict_restores_on_another_world_size(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = fshard.shard_params(model, lambda name, t: fshard.Chunk(0, ALL) if t.ndim == 2 else None)
    assert isinstance(params["0.weight"], fshard.ShardedArray)
    assert isinstance(params["0.bias"], torch.Tensor)
    params["0.bias"].add_(1)  # the result shares no memory with the module
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    fshard.save(tmp_path, params)
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    tree = fshard.load(tmp_path, like=fshard.shard_params(fresh, lambda name, t: fshard.Chunk(-1, [0, 1])))
    fshard.load_state_dict(fresh, tree)
    assert torch.equal(fresh[0].bias, before["0.bias"] + 1)
    assert torch.equal(fresh[2].weight, before["2.weight"])


def test_shard_params_takes_a_state_dict_and_refuses_other_things():
    state = {"w": torch.ones(4, 2), "n": 3}
    out = fshard.shard_params(state, lambda name, t: fshard.Chunk(0, [0, 1]))
    assert out["n"] == 3
    assert out["w"].layout == fshard.Chunk(0, [0, 1]).layout((4, 2))
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.Module or a mapping"):
        fshard.shard_params([torch.ones(1)], lambda name, t: None)


# -- what a save must not write, delete or get wrong ------------------------------------------


def test_one_element_boxes_with_any_stride_are_saved(tmp_path):
    t = torch.arange(4.0)[::2][:1]  # one element, stride 2: contiguous() keeps the stride
    x = fshard.from_local_shards_and_layout(
        [fshard.Shard(fshard.ShardMeta((0,), (1,), 0), t)], fshard.Single(0).layout((1,))
    )
    fshard.save(tmp_path, {"t": t, "x": x, "m": torch.arange(6.0).reshape(3, 2)[1:2, :1]})
    out = fshard.load(tmp_path)
    assert out["t"].tolist() == [0.0]
    assert fshard.gather(out["x"]).tolist() == [0.0]
    assert out["m"].tolist() == [[2.0]]


def test_a_partial_array_is_refused_before_writing_and_cannot_be_a_load_target(saved):
    root, x = saved
    p = fshard.shard(torch.ones(2, 3), fshard.Partial(fshard.Replicated([0, 1])))
    message = r"at \['opt'\]\['p'\] has a pending sum .*Reshard it to a non-partial spec first"
    with pytest.raises(fshard.SpecError, match=message):
        fshard.save(root, {"x": x, "opt": {"p": p}})
    with pytest.raises(fshard.SpecError, match=message):
        fshard.save(root.parent / "new", {"opt": {"p": p}})
    assert not (root.parent / "new").exists()
    assert fshard.load(root)["step"] == 3  # the previous checkpoint is untouched
    partial = fshard.Partial(fshard.Chunk(0, [0, 1]))
    with pytest.raises(fshard.SpecError, match=r"Leaf \['x'\]: the target layout has a pending sum"):
        fshard.load(root, specs={"x": partial, "step": None})
    with pytest.raises(fshard.SpecError, match=r"load into the spec without Partial"):
        fshard.load(root, like={"x": fshard.zeros(partial, *SHAPE), "step": 0})


def test_save_never_deletes_a_data_directory_it_did_not_write(saved):
    root, x = saved
    mine = root / ("data." + "a" * 32)
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    fshard.save(root, {"x": x, "step": 4})
    assert (mine / "notes.txt").read_text() == "keep me"
    assert fshard.load(root)["step"] == 4
    fresh = root.parent / "fresh"
    fresh.mkdir()
    (fresh / ("data." + "b" * 32)).mkdir()
    (fresh / ("data." + "b" * 32) / "notes.txt").write_text("mine")
    with pytest.raises(fshard.CheckpointError, match=r"non-empty directory without index.json .*data\.b{32}"):
        fshard.save(fresh, {"x": x})


def test_trees_deeper_than_the_limit_are_refused(tmp_path):
    deep: list = [1]
    for _ in range(fshard._checkpoint.MAX_DEPTH):
        deep = [deep]
    with pytest.raises(TypeError, match=r"nests deeper than 100 levels at \[0\]\[0\]"):
        fshard.save(tmp_path / "ck", deep)
    loop: list = []
    loop.append(loop)
    with pytest.raises(TypeError, match=r"does a container hold itself"):
        fshard.save(tmp_path / "ck", {"loop": loop})
    assert not (tmp_path / "ck").exists()
    fshard.save(tmp_path / "ck", deep[0])  # 100 levels: saved and loaded
    assert fshard.load(tmp_path / "ck") == deep[0]


def _save_forever(root: Path, stop: threading.Event, count: list[int]) -> None:
    k = 0
    while not stop.is_set():
        k += 1
        x = fshard.shard(torch.full((64, 32), float(k)), fshard.Chunk(0, ALL))
        fshard.save(root, {"x": x, "k": k})
        count.append(k)


def test_a_load_during_saves_sees_one_whole_checkpoint(tmp_path):
    fshard.save(tmp_path, {"x": fshard.shard(torch.zeros(64, 32), fshard.Chunk(0, ALL)), "k": 0})
    stop, saves = threading.Event(), []
    writer = threading.Thread(target=_save_forever, args=(tmp_path, stop, saves))
    writer.start()
    seen, refused = set(), []
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline or len(saves) < 5:
            try:
                out = fshard.load(tmp_path, specs={"x": fshard.Chunk(1, [0, 1]), "k": None})
            except fshard.CheckpointError as exc:  # only when saves replace the index 3 times during one load
                refused.append(str(exc))
                continue
            assert torch.equal(fshard.gather(out["x"]), torch.full((64, 32), float(out["k"])))
            seen.add(out["k"])
    finally:
        stop.set()
        writer.join()
    assert len(seen) > 1  # the loads really overlapped saves
    assert all("changed during load 3 times in a row" in m for m in refused)
    assert len(refused) <= len(seen)
