"""Hugging Face safetensors files and folders on the local backend: load, fuse, rename, save.

Reads are counted by ``fshard._checkpoint._safetensors.counters``: every test that loads
checks that exactly the distinct target boxes' bytes were read.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import fshard
from fshard._checkpoint import _hf_direct, _safetensors
from fshard._checkpoint._hf_write import parse_size, shard_files
from fshard.backends.local import LOCAL

R = [0, 1, 2, 3]
G = torch.Generator().manual_seed(0)
TENSORS = {
    "embed.weight": torch.randn(10, 8, generator=G),
    "layer.qkv.weight": torch.randn(12, 8, generator=G),
    "layer.out.weight": torch.randn(8, 6, generator=G).to(torch.bfloat16),
    "layer.norm.weight": torch.randn(8, generator=G).to(torch.float16),
    "step": torch.tensor(7, dtype=torch.int64),
    "mask": torch.rand(5, 3, generator=G) > 0.5,
    "empty": torch.zeros(0, 4),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _distinct_bytes(arrays: dict[str, Any], itemsize: dict[str, int] | None = None) -> int:
    total = 0
    for name, x in arrays.items():
        boxes = {(s.offsets, s.sizes) for s in x.layout.shards if s.numel}
        total += sum(math.prod(sz) for _, sz in boxes) * (itemsize or {}).get(name, x.dtype.itemsize)
    return total


@pytest.fixture
def one_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, path, metadata={"format": "pt"})
    return path


SPECS = {
    "embed.weight": fshard.Replicated(R),
    "layer.qkv.weight": fshard.Chunk(0, R),
    "layer.out.weight": fshard.Chunk(1, R),
    "layer.norm.weight": fshard.Chunk(0, [1, 2]),
    "step": fshard.Single(3),
    "mask": fshard.Named(fshard.Mesh((2, 2)), ("x", None)),
    "empty": fshard.Chunk(1, R),
}


@pytest.mark.parametrize("where", ["file", "folder", "indexed-folder"])
def test_every_tensor_in_any_layout_bit_identical_reading_only_distinct_boxes(tmp_path: Path, where: str) -> None:
    if where == "indexed-folder":
        fshard.save_safetensors(tmp_path / "ck", TENSORS, max_shard_size=300)
        assert (tmp_path / "ck" / "model.safetensors.index.json").is_file()
        path = tmp_path / "ck"
    else:
        save_file(TENSORS, tmp_path / "model.safetensors", metadata={"format": "pt"})
        path = tmp_path / "model.safetensors" if where == "file" else tmp_path
    _safetensors.counters.reset()
    out = fshard.load(path, specs=SPECS)
    assert set(out) == set(SPECS)
    for name, x in out.items():
        assert isinstance(x, fshard.ShardedArray)
        assert x.layout == SPECS[name].layout(TENSORS[name].shape)
        assert _same(fshard.gather(x), TENSORS[name]), name
    assert _safetensors.counters.bytes_read == _distinct_bytes(out)


def test_a_replicated_box_is_read_once_and_sent_to_the_other_holders(one_file: Path) -> None:
    backend = fshard.backends.local.LocalBackend()
    _safetensors.counters.reset()
    out = fshard.load(one_file, specs={"embed.weight": fshard.Replicated(R)}, backend=backend)
    nbytes = TENSORS["embed.weight"].nbytes
    assert _safetensors.counters.bytes_read == nbytes  # one copy read from disk
    assert backend.counters.elements_sent == (len(R) - 1) * nbytes  # bytes to the three other holders
    assert all(_same(s.data, TENSORS["embed.weight"]) for s in out["embed.weight"].addressable_shards)


def test_replicas_are_read_by_different_ranks_to_balance_bytes() -> None:
    from fshard._checkpoint._hf_plan import plan_reads

    layouts = [fshard.Replicated(R).layout((8, 8)) for _ in range(8)]
    plan = plan_reads(layouts, [4] * 8)
    assert plan.reader is not None
    assert plan.target is not None
    assert sorted(s.placement.rank for s in plan.reader.shards) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert fshard.plan(plan.reader, plan.target).elements_sent == 3 * 8 * 8 * 8 * 4


def test_a_column_block_reads_only_its_runs(one_file: Path) -> None:
    _safetensors.counters.reset()
    out = fshard.load(one_file, specs={"layer.qkv.weight": fshard.Single(0)} | {"embed.weight": fshard.Explicit(
        [((0, 0), (10, 3), 0), ((0, 3), (10, 5), 1)])})  # fmt: skip
    assert _safetensors.counters.bytes_read == TENSORS["layer.qkv.weight"].nbytes + TENSORS["embed.weight"].nbytes
    assert _safetensors.counters.reads == 1 + 2 * 10  # the whole qkv; one run per row of each column block
    assert _same(fshard.gather(out["embed.weight"]), TENSORS["embed.weight"])


def test_specs_as_a_function_a_mapping_or_one_spec(one_file: Path) -> None:
    seen: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def spec(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        seen.append((name, shape, dtype))
        return fshard.Chunk(0, [0, 1]) if len(shape) == 2 and shape[0] else None  # None: not read

    out = fshard.load(one_file, specs=spec)
    assert sorted(seen) == sorted((n, tuple(t.shape), t.dtype) for n, t in TENSORS.items())
    assert set(out) == {"embed.weight", "layer.qkv.weight", "layer.out.weight", "mask"}
    assert set(fshard.load(one_file, specs={"step": fshard.Single(0), "mask": None})) == {"step"}
    two_dims = {n: t for n, t in TENSORS.items() if t.ndim == 2}
    save_file(two_dims, one_file.parent / "two.safetensors")
    out = fshard.load(one_file.parent / "two.safetensors", specs=fshard.Chunk(1, [0, 1]))
    assert {n: _same(fshard.gather(x), two_dims[n]) for n, x in out.items()} == dict.fromkeys(two_dims, True)


def test_like_gives_layouts_plain_tensors_and_dtypes(one_file: Path) -> None:
    like = {
        "layer.qkv.weight": fshard.zeros(fshard.Chunk(0, [0, 1]), 12, 8, dtype=torch.float64, requires_grad=True),
        "step": torch.zeros((), dtype=torch.int64),
    }
    out = fshard.load(one_file, like=like)
    x = out["layer.qkv.weight"]
    assert x.layout == like["layer.qkv.weight"].layout
    assert x.dtype == torch.float64
    assert x.requires_grad
    assert torch.equal(fshard.gather(x).detach(), TENSORS["layer.qkv.weight"].double())
    assert isinstance(out["step"], torch.Tensor)
    assert int(out["step"]) == 7


def test_dtype_casts_after_reading_the_stored_bytes(one_file: Path) -> None:
    _safetensors.counters.reset()
    out = fshard.load(one_file, specs={"layer.out.weight": fshard.Chunk(0, R)}, dtype=torch.float32)
    assert _safetensors.counters.bytes_read == TENSORS["layer.out.weight"].nbytes  # bfloat16 bytes read
    assert _same(fshard.gather(out["layer.out.weight"]), TENSORS["layer.out.weight"].float())


def test_rename_as_a_mapping_or_a_function(one_file: Path) -> None:
    out = fshard.load(one_file, specs={"w": fshard.Single(0)}, rename={"embed.weight": "w"})
    assert _same(fshard.gather(out["w"]), TENSORS["embed.weight"])
    out = fshard.load(one_file, specs={"qkv.weight": fshard.Single(0)}, rename=lambda n: n.removeprefix("layer."))
    assert _same(fshard.gather(out["qkv.weight"]), TENSORS["layer.qkv.weight"])
    with pytest.raises(
        fshard.CheckpointError, match=re.escape("maps both 'embed.weight' and 'layer.qkv.weight' to 'x'")
    ):
        fshard.load(
            one_file,
            specs=fshard.Single(0),
            rename=lambda n: "x" if "." in n and "norm" not in n and "out" not in n else n,
        )
    with pytest.raises(TypeError, match=re.escape("rename= gave 3 for 'step': give a str")):
        fshard.load(one_file, specs=fshard.Single(0), rename=lambda n: 3)


def test_rename_refuses_a_mapping_of_a_name_the_checkpoint_lacks(one_file: Path) -> None:
    """A misspelt name would leave the tensor it meant under its old name: refused, naming the close ones."""
    with pytest.raises(fshard.CheckpointError, match=re.escape("maps ['embed.weights'], which the checkpoint lacks")):
        fshard.load(one_file, specs={"w": fshard.Single(0)}, rename={"embed.weights": "w"})
    with pytest.raises(fshard.CheckpointError, match=re.escape("(close: ['embed.weight'")):
        fshard.load(one_file, specs={"w": fshard.Single(0)}, rename={"embed.weights": "w"})
    out = fshard.load(one_file, specs=fshard.Single(0), rename=lambda n: {"embed.weights": "w"}.get(n, n))
    assert "w" not in out  # a function: names it gives back stay, as documented
    assert "embed.weight" in out


QKV = TENSORS["layer.qkv.weight"]


def test_split_reads_each_part_from_the_fused_tensor(one_file: Path) -> None:
    split = fshard.Split("layer.qkv.weight", 0, {"q": 4, "k": 4, "v": 4})
    specs = {"q": fshard.Chunk(0, R), "k": fshard.Chunk(1, [0, 1]), "v": fshard.Replicated([2, 3])}
    _safetensors.counters.reset()
    out = fshard.load(one_file, specs=specs, fuse=[split])
    assert _same(fshard.gather(out["q"]), QKV[:4])
    assert _same(fshard.gather(out["k"]), QKV[4:8])
    assert _same(fshard.gather(out["v"]), QKV[8:])
    assert _safetensors.counters.bytes_read == QKV.nbytes  # v read once, q and k only their boxes
    assert "layer.qkv.weight" not in fshard.load(one_file, specs=fshard.Single(0), fuse=[split])


def test_concat_reads_each_box_from_its_sources(tmp_path: Path) -> None:
    q, k, v = QKV[:4], QKV[4:6], QKV[6:]
    save_file(
        {"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(), "u": torch.zeros(3)}, tmp_path / "m.safetensors"
    )
    for spec in (fshard.Chunk(0, R), fshard.Chunk(1, R), fshard.Named(fshard.Mesh((2, 2)), ("x", "y"))):
        _safetensors.counters.reset()
        out = fshard.load(
            tmp_path / "m.safetensors", specs={"qkv": spec}, fuse=[fshard.Concat(["q", "k", "v"], 0, "qkv")]
        )
        assert _same(fshard.gather(out["qkv"]), QKV)
        assert out["qkv"].layout == spec.layout((12, 8))
        assert _safetensors.counters.bytes_read == QKV.nbytes


def test_split_then_concat_along_another_dim(one_file: Path) -> None:
    fuse = [
        fshard.Split("layer.qkv.weight", 1, {"left": 3, "right": 5}),
        fshard.Concat(["right", "left"], 1, "swapped"),
        fshard.Split("swapped", 0, {"top": 5, "bottom": 7}),
    ]
    out = fshard.load(one_file, specs={"top": fshard.Chunk(1, R), "bottom": fshard.Chunk(0, [0, 1])}, fuse=fuse)
    swapped = torch.cat([QKV[:, 3:], QKV[:, :3]], 1)
    assert _same(fshard.gather(out["top"]), swapped[:5])
    assert _same(fshard.gather(out["bottom"]), swapped[5:])


FUSE_ERRORS = [
    (
        "missing-source",
        [fshard.Split("qkv", 0, {"a": 12})],
        "the checkpoint has no tensor 'qkv' (after rename= and earlier fuse=)",
    ),
    (
        "near-names",
        [fshard.Split("weight", 0, {"a": 12})],
        "(names ending alike: ['embed.weight', 'layer.qkv.weight', 'layer.out.weight'])",
    ),
    (
        "sizes",
        [fshard.Split("layer.qkv.weight", 0, {"a": 5, "b": 5})],
        "the parts add up to 10 along dim 0, but 'layer.qkv.weight' has shape (12, 8)",
    ),
    ("dim", [fshard.Split("layer.qkv.weight", 2, {"a": 8})], "dim 2 is out of range for a tensor of shape (12, 8)"),
    (
        "dtypes",
        [fshard.Concat(["embed.weight", "layer.out.weight"], 1, "x")],
        "'layer.out.weight' is torch.bfloat16 of shape (8, 6)",
    ),
    (
        "shapes",
        [fshard.Concat(["embed.weight", "layer.qkv.weight"], 1, "x")],
        "sources must share dtype and every size but the one along dim 1",
    ),
    ("taken", [fshard.Split("layer.qkv.weight", 0, {"embed.weight": 12})], "the name 'embed.weight' is taken"),
    ("twice", [fshard.Concat(["embed.weight", "embed.weight"], 0, "x")], "a source appears twice"),
]


@pytest.mark.parametrize(("fuse", "phrase"), [c[1:] for c in FUSE_ERRORS], ids=[c[0] for c in FUSE_ERRORS])
def test_fuse_errors_name_the_declaration(one_file: Path, fuse: list[Any], phrase: str) -> None:
    with pytest.raises(fshard.CheckpointError, match=re.escape(f"{fuse[0]!r}: ")) as info:
        fshard.load(one_file, specs=fshard.Single(0), fuse=fuse)
    assert phrase in str(info.value)


@pytest.mark.parametrize(
    ("make", "error", "phrase"),
    [
        (lambda: fshard.Split("x", 0, {}), TypeError, "Split parts must be a non-empty mapping"),
        (lambda: fshard.Split("x", 0, {"a": -1}), fshard.SpecError, "Split part 'a' has size -1"),
        (lambda: fshard.Split("x", True, {"a": 1}), TypeError, "Split dim must be an int, got True"),
        (lambda: fshard.Concat("qkv", 0, "x"), TypeError, "Concat sources must be a non-empty sequence of names"),
        (lambda: fshard.Concat(["a"], 0, ""), TypeError, "Concat name must be a non-empty str"),
    ],
    ids=["no-parts", "negative", "bool-dim", "str-sources", "empty-name"],
)
def test_split_and_concat_check_their_arguments(make: Any, error: type[Exception], phrase: str) -> None:
    with pytest.raises(error, match=re.escape(phrase)):
        make()


def test_split_and_concat_are_values() -> None:
    a = fshard.Split("x", 0, {"a": 1, "b": 2})
    assert a == fshard.Split("x", 0, {"a": 1, "b": 2})
    assert hash(a) == hash(fshard.Split("x", 0, {"a": 1, "b": 2}))
    assert a != fshard.Split("x", 0, {"b": 2, "a": 1})  # the order of the parts is their order along dim
    assert fshard.Concat(["a", "b"], 1, "c") == fshard.Concat(("a", "b"), 1, "c")


LOAD_ERRORS = [
    (
        {"specs": {"nope": fshard.Single(0)}},
        fshard.CheckpointError,
        "load() specs= names 'nope', which the checkpoint does not hold",
    ),
    ({"like": {"nope": torch.zeros(1)}}, fshard.CheckpointError, "load() like= names 'nope'"),
    (
        {"like": {"step": torch.zeros(2)}},
        fshard.CheckpointError,
        "Tensor 'step' of the checkpoint has shape (), like= has (2,)",
    ),
    ({"like": {"step": 3}}, TypeError, "like= gives a int for 'step'"),
    (
        {"like": {"embed.weight": torch.zeros(10, 8, dtype=torch.int8)}},
        fshard.CheckpointError,
        "Tensor 'embed.weight' of the checkpoint is torch.float32, like= has torch.int8: like= casts to its dtype "
        "only where torch.can_cast allows it",
    ),
    ({"like": [1]}, TypeError, "like= of a Hugging Face checkpoint takes a mapping of names, got list"),
    (
        {"specs": {"step": fshard.Partial(fshard.Replicated(R))}},
        fshard.SpecError,
        "Tensor 'step': the target layout has a pending sum",
    ),
    (
        {"specs": {"step": fshard.Chunk(0, R)}},
        fshard.SpecError,
        "Tensor 'step' (torch.int64, shape ()): Invalid sharding dim",
    ),
    (
        {"specs": fshard.Single(0), "dtype": "float32"},
        TypeError,
        "load() dtype= takes a torch.dtype or None, got 'float32'",
    ),
    (
        {"specs": fshard.Single(0), "fuse": fshard.Split("x", 0, {"a": 1})},
        TypeError,
        "fuse= takes a list of fshard.Split and fshard.Concat",
    ),
    ({"specs": fshard.Single(0), "rename": 3}, TypeError, "rename= takes a mapping or a function of the name, got int"),
]


@pytest.mark.parametrize(("kwargs", "error", "phrase"), LOAD_ERRORS, ids=[e[2][:40] for e in LOAD_ERRORS])
def test_load_errors(one_file: Path, kwargs: dict[str, Any], error: type[Exception], phrase: str) -> None:
    with pytest.raises(error, match=re.escape(phrase)):
        fshard.load(one_file, **kwargs)


def test_hugging_face_options_on_an_fshard_checkpoint_are_refused(tmp_path: Path) -> None:
    fshard.save(tmp_path / "ck", {"w": torch.ones(2)})
    with pytest.raises(TypeError, match=re.escape("dtype=, rename= and fuse= apply to Hugging Face checkpoints")):
        fshard.load(tmp_path / "ck", specs={"w": None}, dtype=torch.float64)


def test_a_dcp_folder_goes_to_the_dcp_reader_and_refuses_hugging_face_options(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(fshard.CheckpointError, match=re.escape("is not a readable DCP metadata pickle")):
        fshard.load(tmp_path, specs=fshard.Single(0))
    with pytest.raises(TypeError, match=re.escape("apply to Hugging Face checkpoints, not to DCP folders")):
        fshard.load(tmp_path, specs=fshard.Single(0), fuse=[fshard.Split("a", 0, {"b": 1})])


# -- save_safetensors ------------------------------------------------------------------------------


def _arrays() -> dict[str, Any]:
    return {
        "embed.weight": fshard.shard(TENSORS["embed.weight"], fshard.Replicated(R)),
        "layer": {
            "qkv.weight": fshard.shard(TENSORS["layer.qkv.weight"], fshard.Chunk(1, [0, 1, 2])),
            "out.weight": fshard.shard(TENSORS["layer.out.weight"], fshard.Named(fshard.Mesh((2, 2)), ("x", "y"))),
            "norm.weight": TENSORS["layer.norm.weight"],
        },
        "step": fshard.shard(TENSORS["step"], fshard.Single(2)),
        "mask": fshard.shard(TENSORS["mask"], fshard.Chunk(0, R)),
        "empty": fshard.shard(TENSORS["empty"], fshard.Chunk(1, [0, 1])),
    }


def test_one_file_is_byte_for_byte_what_safetensors_writes(tmp_path: Path) -> None:
    fshard.save_safetensors(tmp_path / "ck", _arrays())
    assert sorted(os.listdir(tmp_path / "ck")) == ["model.safetensors"]
    save_file(TENSORS, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_every_byte_is_written_once_by_one_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[int] = []
    real = _hf_direct.write_runs

    def counted(fd: int, base: int, spans: Any, data: Any) -> None:
        written.append(int(spans[2].sum()))
        real(fd, base, spans, data)

    monkeypatch.setattr(_hf_direct, "write_runs", counted)
    fshard.save_safetensors(tmp_path / "ck", _arrays())
    save_file(TENSORS, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    reference = (tmp_path / "reference.safetensors").read_bytes()
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == reference
    header = 8 + int.from_bytes(reference[:8], "little")
    assert sum(written) == len(reference)  # the header once, and each box of each tensor once
    assert written[0] == header


def test_sharded_files_and_index_as_huggingface_hub_cuts_them(tmp_path: Path) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    fshard.save_safetensors(tmp_path / "ck", _arrays(), max_shard_size="300B")
    split = split_torch_state_dict_into_shards(TENSORS, max_shard_size=300)
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert index == {
        "metadata": {"total_size": sum(t.nbytes for t in TENSORS.values())},
        "weight_map": split.tensor_to_filename,
    }
    assert sorted(os.listdir(tmp_path / "ck")) == sorted([*split.filename_to_tensors, "model.safetensors.index.json"])
    for file, names in split.filename_to_tensors.items():
        back = load_file(tmp_path / "ck" / file)
        assert sorted(back) == sorted(names)
        assert all(_same(back[n], TENSORS[n]) for n in names)
        raw = (tmp_path / "ck" / file).read_bytes()
        assert json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"] == {"format": "pt"}


def test_a_tensor_that_a_listed_file_holds_and_the_index_leaves_out_is_read_as_transformers_reads_it(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ck"
    fshard.save_safetensors(folder, {"a": torch.ones(100), "b": torch.full((100,), 2.0), "c": torch.zeros(1000)},
                            max_shard_size="1KB")  # fmt: skip
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    assert index["weight_map"]["a"] == index["weight_map"]["b"]  # a and b share a file
    del index["weight_map"]["b"]
    path.write_text(json.dumps(index))
    got = fshard.load(folder)
    assert sorted(got) == ["a", "b", "c"]
    assert torch.equal(got["b"], torch.full((100,), 2.0))
    index["weight_map"]["d"] = "model-extra.safetensors"  # now two listed files hold b, and the index names neither
    save_file({"b": torch.full((100,), 3.0), "d": torch.ones(1)}, folder / "model-extra.safetensors")
    path.write_text(json.dumps(index))
    with pytest.raises(fshard.CheckpointError, match=r"Tensor 'b' is in both .* names neither"):
        fshard.load(folder)


def test_shard_files_matches_huggingface_hub_on_many_sizes() -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        sizes = torch.randint(0, 50, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        limit = int(torch.randint(1, 120, (1,), generator=g))
        sd = {f"t{i:02d}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
        split = split_torch_state_dict_into_shards(sd, max_shard_size=limit)
        ours = [[f"t{i:02d}" for i in f] for f in shard_files(sizes, limit)]
        assert ours == list(split.filename_to_tensors.values()), (sizes, limit)


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("100KB", 10**5), ("512MiB", 512 << 20), ("2gib", 2 << 30), (" 7 ", 7), (300, 300)],
)
def test_max_shard_size_units(text: Any, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["5XB", "-1GB", "0", 0, -3, True, 2.5, "GB"])
def test_a_bad_max_shard_size_is_refused(bad: Any) -> None:
    with pytest.raises(fshard.SpecError, match=re.escape(f"max_shard_size={bad!r}: give a positive int of bytes")):
        parse_size(bad)


def test_loads_back_into_any_layout(tmp_path: Path) -> None:
    fshard.save_safetensors(tmp_path / "ck", _arrays(), max_shard_size=200)
    out = fshard.load(tmp_path / "ck", specs=lambda n, s, d: fshard.Chunk(0, [0, 1]) if s else fshard.Single(1))
    assert {n: _same(fshard.gather(x), TENSORS[n]) for n, x in out.items()} == dict.fromkeys(TENSORS, True)


SAVE_ERRORS = [
    ({"x": 3}, TypeError, "save_safetensors() tree holds a int at 'x': give ShardedArrays or tensors"),
    ([torch.ones(1)], TypeError, "tree must be a dict of names to arrays and tensors, got list"),
    ({1: torch.ones(1)}, TypeError, "tree key 1 at the root is not a str"),
    ({"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)}, TypeError, "tree names 'a.b' twice"),
    ({"__metadata__": torch.ones(2), "w": torch.zeros(3)}, TypeError, "names a tensor '__metadata__', the key a"),
    ({"p": fshard.Partial(fshard.Replicated([0, 1]))}, fshard.SpecError, "has a pending sum"),
]


@pytest.mark.parametrize(
    ("tree", "error", "phrase"), SAVE_ERRORS, ids=["scalar", "list", "int-key", "twice", "metadata-key", "partial"]
)
def test_save_errors(tmp_path: Path, tree: Any, error: type[Exception], phrase: str) -> None:
    if isinstance(tree, dict) and isinstance(tree.get("p"), fshard.Partial):
        tree = {"p": fshard.shard(torch.ones(2), tree["p"])}
    with pytest.raises(error, match=re.escape(phrase)):
        fshard.save_safetensors(tmp_path / "ck", tree)
    assert not (tmp_path / "ck").exists()
    assert os.listdir(tmp_path) == []


def test_a_file_or_an_fshard_checkpoint_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(fshard.CheckpointError, match="exists and is not a folder"):
        fshard.save_safetensors(tmp_path / "file", {"w": torch.ones(1)})
    fshard.save(tmp_path / "ck", {"w": torch.ones(1)})
    with pytest.raises(fshard.CheckpointError, match="is an fshard checkpoint"):
        fshard.save_safetensors(tmp_path / "ck", {"w": torch.ones(1)})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process: no group, as meant
        dcp.save({"old": torch.zeros(4)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    with pytest.raises(fshard.CheckpointError, match=r"is a torch DCP checkpoint \(it holds \.metadata\)"):
        fshard.save_safetensors(tmp_path / "dcp", {"new": torch.ones(4)})  # load() would read the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "dcp", "file"]
    assert list(fshard.load(tmp_path / "dcp")) == ["old"]


def test_a_save_into_a_new_folder_that_another_save_made_meanwhile_raises_and_mixes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second save to finish finds the folder made by the first: it commits nothing, rather than its files."""
    folder = tmp_path / "ck"
    write = _hf_direct.write_runs

    def meanwhile(*args: Any) -> None:  # another save begins and commits while this one writes
        monkeypatch.setattr(_hf_direct, "write_runs", write)
        fshard.save_safetensors(folder, {"w": torch.full((40,), 2.0), "b": torch.full((3,), 2.0)}, max_shard_size=100)
        write(*args)

    monkeypatch.setattr(_hf_direct, "write_runs", meanwhile)
    with pytest.raises(fshard.CheckpointError, match=r"was made by another save while this one wrote"):
        fshard.save_safetensors(folder, {"w": torch.full((40,), 1.0), "b": torch.full((3,), 1.0)}, max_shard_size=100)
    got = fshard.load(folder)
    assert {n: t.unique().tolist() for n, t in got.items()} == {"b": [2.0], "w": [2.0]}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no staging folder left


def test_a_failed_write_leaves_no_folder_and_no_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_hf_direct, "write_runs", broken)
    with pytest.raises(
        fshard.CheckpointError, match=re.escape("No space left on device (errno 28). Nothing was committed")
    ):
        fshard.save_safetensors(tmp_path / "ck", _arrays(), max_shard_size=200)
    assert os.listdir(tmp_path) == []


def test_into_an_existing_folder_replaces_weights_and_keeps_other_files(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    fshard.save_safetensors(folder, _arrays(), max_shard_size=200)
    (folder / "config.json").write_text("{}")
    before = sorted(os.listdir(folder))
    assert len(before) > 3
    fshard.save_safetensors(folder, {"w": torch.ones(3)})  # one file now: the old shards and index go
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert list(fshard.load(folder, specs=fshard.Single(0))) == ["w"]
    fshard.save_safetensors(folder, _arrays(), max_shard_size=200)
    assert sorted(os.listdir(folder)) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no staging folder left


def test_load_after_save_on_the_local_backend_reads_the_same_values_as_safetensors(tmp_path: Path) -> None:
    fshard.save_safetensors(tmp_path / "ck", _arrays(), max_shard_size=120)
    files = sorted((tmp_path / "ck").glob("*.safetensors"))
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged |= load_file(f)
    assert {n: _same(merged[n], t) for n, t in TENSORS.items()} == dict.fromkeys(TENSORS, True)
    out = fshard.load(
        tmp_path / "ck",
        like={n: fshard.zeros(fshard.Replicated([0, 1]), *t.shape, dtype=t.dtype) for n, t in TENSORS.items()},
        backend=LOCAL,
    )
    assert all(_same(fshard.gather(out[n]), t) for n, t in TENSORS.items())


def test_without_specs_or_like_every_tensor_is_a_plain_tensor(one_file: Path) -> None:
    _safetensors.counters.reset()
    out = fshard.load(one_file)
    assert all(type(t) is torch.Tensor for t in out.values())
    assert {n: _same(t, TENSORS[n]) for n, t in out.items()} == dict.fromkeys(TENSORS, True)
    assert _safetensors.counters.bytes_read == sum(t.nbytes for t in TENSORS.values())
    assert fshard.load(one_file, dtype=torch.float64)["embed.weight"].dtype == torch.float64
