"""``fshard convert`` and ``fshard info``: DCP, fshard and Hugging Face sources; fshard and Hugging Face targets."""

from __future__ import annotations

import json
import re
import shutil
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import fshard
from fshard import __main__ as cli
from fshard import _convert
from fshard._checkpoint import _stream
from fshard._convert import convert

_G = torch.Generator().manual_seed(5)
DENSE = {
    "model.embed": torch.randn(9, 6, generator=_G),
    "model.proj": torch.randn(8, 5, generator=_G).t(),  # stored transposed by torch.save
    "model.norm": torch.randn(6, generator=_G).to(torch.bfloat16),
    "model.ids": torch.arange(7, dtype=torch.int64),
    "model.empty": torch.zeros(0, 2),
    "scale": torch.tensor(0.25, dtype=torch.float64),
}
HAS_HF_WRITER = hasattr(fshard, "save_safetensors")
needs_hf_writer = pytest.mark.skipif(not HAS_HF_WRITER, reason="fshard.save_safetensors is not in this build")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _nested() -> dict[str, object]:
    model = {k.split(".", 1)[1]: v for k, v in DENSE.items() if k.startswith("model.")}
    return {"model": model, "scale": DENSE["scale"], "epoch": 3}


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(_nested(), checkpoint_id=path, no_dist=True)
    return path


def test_dcp_to_fshard(dcp_folder: Path, tmp_path: Path) -> None:
    line = convert(dcp_folder, tmp_path / "ck")
    assert line == (
        f"6 tensors (452 B) from dcp {dcp_folder} to fshard {tmp_path / 'ck'}; not converted (not tensors): epoch"
    )
    out = fshard.load(tmp_path / "ck")  # verifies every sha256
    assert sorted(out) == sorted(DENSE)
    assert all(_same(out[k], v) for k, v in DENSE.items())


def test_blocks_stay_within_max_memory(dcp_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    write = _stream.SafetensorsWriter.write
    monkeypatch.setattr(_stream.SafetensorsWriter, "write", lambda self, b: sizes.append(b.nbytes) or write(self, b))
    convert(dcp_folder, tmp_path / "ck", max_memory=16)
    assert max(sizes) == 16
    assert sum(sizes) == sum(t.nbytes for t in DENSE.values())
    out = fshard.load(tmp_path / "ck")
    assert all(_same(out[k], v) for k, v in DENSE.items())


def test_fshard_to_fshard_keeps_the_tree_and_scalars(tmp_path: Path) -> None:
    x = fshard.shard(DENSE["model.embed"], fshard.Named(fshard.Mesh((2, 2)), ("x", "y")))
    fshard.save(tmp_path / "a", {"params": {"x": x, "norm": DENSE["model.norm"]}, "opt": [DENSE["model.ids"], 0.5]})
    convert(tmp_path / "a", tmp_path / "b", to="fshard", max_memory=40)
    out = fshard.load(tmp_path / "b")
    assert _same(out["params"]["x"], DENSE["model.embed"])  # arrays become whole tensors
    assert _same(out["params"]["norm"], DENSE["model.norm"])
    assert _same(out["opt"][0], DENSE["model.ids"])
    assert out["opt"][1] == 0.5


def test_a_tampered_fshard_source_is_refused(tmp_path: Path) -> None:
    fshard.save(tmp_path / "a", {"w": DENSE["model.embed"]})
    data = next((tmp_path / "a").glob("data.*")) / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(fshard.CheckpointError, match=re.escape("does not match its sha256 in index.json")):
        convert(tmp_path / "a", tmp_path / "b", to="fshard")
    convert(tmp_path / "a", tmp_path / "c", to="fshard", verify=False)  # on request, as it is
    assert not torch.equal(fshard.load(tmp_path / "c")["w"], DENSE["model.embed"])


def test_hugging_face_file_and_folder_to_fshard(tmp_path: Path) -> None:
    tensors = {k: v.contiguous() for k, v in DENSE.items() if k != "scale"}
    save_file(tensors, tmp_path / "one.safetensors")
    folder = tmp_path / "hf"
    folder.mkdir()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:2]}, folder / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[2:]}, folder / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 + (i >= 2)}-of-00002.safetensors" for i, k in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for src in (tmp_path / "one.safetensors", folder):
        convert(src, tmp_path / "ck")
        out = fshard.load(tmp_path / "ck")
        assert sorted(out) == names
        assert all(_same(out[k], v) for k, v in tensors.items())


def _fake_save_safetensors(path: Path, tree: dict[str, torch.Tensor], *, max_shard_size: int) -> None:
    """Stands in for the Hugging Face writer: one model.safetensors when everything fits."""
    assert sum(t.nbytes for t in tree.values()) <= max_shard_size
    Path(path).mkdir(parents=True)
    save_file(tree, Path(path) / "model.safetensors", metadata={"format": "pt"})


def test_to_hugging_face_in_files_of_at_most_max_shard_size(
    dcp_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fshard, "save_safetensors", _fake_save_safetensors, raising=False)
    convert(dcp_folder, tmp_path / "hf", to="hf", max_shard_size=100)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    for f in files:  # at most 100 bytes per file, or one tensor that alone is larger
        held = [DENSE[k].nbytes for k, v in index["weight_map"].items() if v == f]
        assert sum(held) <= 100 or len(held) == 1
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in DENSE.values())}
    loaded = {k: v for f in files for k, v in load_file(tmp_path / "hf" / f).items()}
    assert sorted(loaded) == sorted(DENSE)
    assert all(_same(loaded[k], v) for k, v in DENSE.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left behind


@needs_hf_writer
@pytest.mark.parametrize("max_shard_size", ["5GB", 100])
def test_dcp_and_fshard_to_hugging_face(dcp_folder: Path, tmp_path: Path, max_shard_size: object) -> None:
    convert(dcp_folder, tmp_path / "hf", to="hf", max_shard_size=max_shard_size)  # type: ignore[arg-type]
    back = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(back) == sorted(DENSE)
    assert all(_same(back[k], v) for k, v in DENSE.items())
    convert(tmp_path / "hf", tmp_path / "ck")
    convert(tmp_path / "ck", tmp_path / "hf2")  # fshard -> Hugging Face is the default direction
    again = {k: v for f in sorted((tmp_path / "hf2").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert all(_same(again[k], v) for k, v in DENSE.items())


def test_errors(dcp_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(fshard.CheckpointError, match=re.escape("the target")):
        convert(dcp_folder, dcp_folder)
    with pytest.raises(fshard.SpecError, match=re.escape("to= takes 'fshard' or 'hf', got 'pt'")):
        convert(dcp_folder, tmp_path / "x", to="pt")
    with pytest.raises(fshard.SpecError, match=re.escape("max_memory must be a positive number of bytes")):
        convert(dcp_folder, tmp_path / "x", max_memory="lots")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    monkeypatch.setattr(fshard, "save_safetensors", _fake_save_safetensors, raising=False)
    with pytest.raises(fshard.CheckpointError, match=re.escape("exists and is not empty")):
        convert(dcp_folder, tmp_path / "full", to="hf")
    with pytest.raises(fshard.CheckpointError, match=re.escape("hold more than max_memory=16 bytes")):
        convert(dcp_folder, tmp_path / "x", to="hf", max_memory=16)


def test_to_hugging_face_is_what_save_file_writes_one_tensor_at_a_time(
    dcp_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    from safetensors.torch import save_file

    from fshard import _convert

    live, most = [0], [0]
    real = _convert._whole

    def tracked(source, k):
        live[0] += 1
        most[0] = max(most[0], live[0])
        t = real(source, k)
        weakref.finalize(t, lambda: live.__setitem__(0, live[0] - 1))
        return t

    monkeypatch.setattr(_convert, "_whole", tracked)
    convert(dcp_folder, tmp_path / "hf", to="hf")
    save_file({k: v.contiguous() for k, v in DENSE.items()}, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert most[0] == 1  # never two tensors in memory at once


# -- the command line -------------------------------------------------------------------------------


def test_cli_convert_and_info(dcp_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["convert", str(dcp_folder), str(tmp_path / "ck"), "--max-memory", "1KiB"], prog="fshard") == 0
    assert capsys.readouterr().out.startswith(f"converted 6 tensors (452 B) from dcp {dcp_folder} to fshard")
    assert all(_same(fshard.load(tmp_path / "ck")[k], v) for k, v in DENSE.items())
    assert cli.main(["info", str(dcp_folder)], prog="fshard") == 0
    text = capsys.readouterr().out.splitlines()
    assert (
        text[0] == f"torch DCP checkpoint {dcp_folder} (version 1.0.0): 6 tensors (452 B) and 1 other entry in 1 file"
    )
    assert "model.proj: float32 (5, 8), 1 chunk in __0_0.distcp" in text
    assert "epoch: not a tensor (1261 bytes in __0_0.distcp; fshard.load returns them raw)" in text
    assert cli.main(["info", str(tmp_path / "ck")], prog="fshard") == 0
    assert "['model.norm']: tensor bfloat16 (6,), 1 box written" in capsys.readouterr().out


def test_cli_info_of_a_hugging_face_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file({"b": torch.zeros(2, 3), "a": torch.ones(4, dtype=torch.int8)}, tmp_path / "model.safetensors")
    assert cli.main(["info", str(tmp_path)], prog="fshard") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"Hugging Face safetensors {tmp_path}: 2 tensors (28 B) in 1 file",
        "a: int8 (4,) in model.safetensors",
        "b: float32 (2, 3) in model.safetensors",
    ]


def test_info_of_a_folder_without_tensors_names_its_file(tmp_path: Path) -> None:
    fshard.save_safetensors(tmp_path, {})  # writes model.safetensors, holding no tensor
    assert fshard.checkpoint_info(tmp_path) == f"Hugging Face safetensors {tmp_path}: 0 tensors (0 B) in 1 file"


def test_info_of_a_dcp_entry_without_elements(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save({"z": torch.zeros(0, 3), "w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    assert "z: float32 (0, 3), 0 chunks (no elements to store)" in fshard.checkpoint_info(tmp_path).splitlines()


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["convert", "a"], 2, "the following arguments are required: dst"),
        (["convert", "a", "b", "--max-memory", "0"], 2, "--max-memory must be a positive number of bytes"),
        (["convert", "a", "b", "--to", "pt"], 2, "argument --to: invalid choice: 'pt'"),
        (["convert", "/no/such/dir", "/tmp/x"], 1, "/no/such/dir does not exist: give an fshard checkpoint's folder"),
        (["info", "/no/such/dir"], 1, "/no/such/dir does not exist: give an fshard checkpoint's folder"),
    ],
    ids=["missing-dst", "bad-size", "bad-to", "missing-src", "info-missing"],
)
def test_cli_errors(argv: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    if code == 2:
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv, prog="fshard")
        assert exit_.value.code == 2
    else:
        assert cli.main(argv, prog="fshard") == 1
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_parse_size() -> None:
    assert [_convert.parse_size(s) for s in ("1KiB", "1kb", "2.5MB", "3 GiB", 7)] == [1024, 1000, 2_500_000, 3 << 30, 7]


def test_no_staging_left_after_a_failed_hugging_face_write(dcp_folder: Path, tmp_path: Path, monkeypatch) -> None:
    from fshard import _convert

    def broken(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_convert, "write_runs", broken)
    with pytest.raises(fshard.CheckpointError, match="No space left on device"):
        convert(dcp_folder, tmp_path / "hf", to="hf")
    assert list(tmp_path.iterdir()) == []
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_two_tensors_of_one_dotted_name_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    fshard.save(tmp_path / "fs", {"a": {"b": torch.ones(2, 2)}, "a.b": torch.zeros(3)})
    with pytest.raises(fshard.CheckpointError, match=r"'a\.b' names two tensors of the source .* rename one"):
        convert(tmp_path / "fs", tmp_path / "hf", to="hf")
    assert not (tmp_path / "hf").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["fs"]  # no staging folder left behind


def test_a_source_without_tensors_becomes_what_save_safetensors_writes(tmp_path: Path) -> None:
    fshard.save(tmp_path / "ck", {"step": 3})
    line = convert(tmp_path / "ck", tmp_path / "hf", to="hf")
    assert line.startswith("0 tensors (0 B) from fshard")
    fshard.save_safetensors(tmp_path / "ref", {})
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()
    assert fshard.load(tmp_path / "hf") == {}
    assert load_file(tmp_path / "hf" / "model.safetensors") == {}


def test_a_tensor_named_like_the_safetensors_metadata_is_refused(tmp_path: Path) -> None:
    fshard.save(tmp_path / "fs", {"__metadata__": torch.ones(2)})
    with pytest.raises(fshard.CheckpointError, match=r"cannot name a tensor '__metadata__'.* convert to fshard"):
        convert(tmp_path / "fs", tmp_path / "hf", to="hf")
    assert [p.name for p in tmp_path.iterdir()] == ["fs"]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("to", ["fshard", "hf"])
def test_a_dtype_neither_target_stores_is_named(tmp_path: Path, to: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"z": torch.zeros(2, dtype=torch.complex32), "w": torch.ones(2)}, checkpoint_id=tmp_path / "d", no_dist=True
        )
    with pytest.raises(fshard.CheckpointError, match=re.escape("holds torch.complex32 tensors ['z'], a dtype that")):
        convert(tmp_path / "d", tmp_path / "out", to=to)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


@pytest.mark.parametrize("kind", ["fshard", "dcp", "hf"])
def test_a_spec_that_does_not_fit_a_leaf_names_it(tmp_path: Path, kind: str) -> None:
    tree = {"w": torch.ones(4, 4), "opt": {"step": torch.tensor(10.0)}}
    if kind == "fshard":
        fshard.save(tmp_path / "ck", tree)
        where = r"Leaf \['opt'\]\['step'\] \(torch.float32, shape \(\)\)"
    elif kind == "dcp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(tree, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        where = r"Tensor 'opt.step' \(torch.float32, shape \(\)\)"
    else:
        save_file({"w": tree["w"], "opt.step": tree["opt"]["step"]}, tmp_path / "ck")
        where = r"Tensor 'opt.step' \(torch.float32, shape \(\)\)"
    with pytest.raises(fshard.SpecError, match=where + r": Invalid sharding dim: 0 for a 0-D array"):
        fshard.load(tmp_path / "ck", specs=fshard.Chunk(0, [0, 1]))


def test_a_max_memory_below_one_element_is_refused_before_anything_is_written(
    dcp_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out"
    assert cli.main(["convert", str(dcp_folder), str(target), "--max-memory", "2"], prog="fshard") == 1
    err = capsys.readouterr().err
    assert "fshard convert: --max-memory 2 bytes holds less than one element of" in err  # its option, not the keyword
    assert "convert()" not in err
    assert "max_memory" not in err
    assert "raise it to at least" in err
    assert "Traceback" not in err
    assert not target.exists()


def test_the_command_names_its_own_options_in_its_errors(
    dcp_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli.main(["convert", str(dcp_folder), str(tmp_path / "x"), "--to", "hf", "--max-memory", "16"], prog="fshard")
        == 1
    )
    err = capsys.readouterr().err
    assert "hold more than --max-memory 16 bytes: raise --max-memory, or convert to fshard" in err
    assert cli.main(["convert", str(dcp_folder), str(dcp_folder)], prog="fshard") == 1
    err = capsys.readouterr().err
    assert err.startswith("fshard convert: convert writes a new checkpoint: the target ")
    assert "convert()" not in err


def test_folders_of_formats_fshard_does_not_read_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    config.save_pretrained(tmp_path / "bin")  # a folder of the older kind: its weights a torch.save pickle
    torch.save(transformers.GPT2LMHeadModel(config).state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dcp.save: "torch.distributed is disabled ... single process"
        dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "per-rank", no_dist=True, use_collectives=False)
    (tmp_path / "empty").mkdir()
    expected = {
        "bin": "holds PyTorch .bin weights (torch.save pickles), which fshard does not read",
        "per-rank": "holds torch DCP data files but no .metadata file: a folder saved with use_collectives=False",
        "empty": "holds no .metadata (torch DCP) or .safetensors files (Hugging Face): it is no checkpoint",
    }
    for name, message in expected.items():
        assert cli.main(["info", str(tmp_path / name)], prog="fshard") == 1
        assert message in capsys.readouterr().err, name
        with pytest.raises(fshard.CheckpointError, match=re.escape(message)):
            fshard.load(tmp_path / name)


def test_info_into_a_closed_pipe_ends_quietly(dcp_folder: Path) -> None:
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: a write raises BrokenPipeError
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fshard", "info", str(dcp_folder)], stdout=write, stderr=subprocess.PIPE, timeout=120
        )
    finally:
        os.close(write)
    assert done.returncode == 0
    assert b"Traceback" not in done.stderr


def test_a_destination_that_cannot_be_made_is_one_line(dcp_folder: Path, tmp_path: Path, capsys) -> None:
    """Before, a destination under a file printed Python's NotADirectoryError traceback."""
    (tmp_path / "file").write_text("x")
    for to in ("hf", "fshard"):
        assert cli.main(["convert", str(dcp_folder), str(tmp_path / "file" / "sub"), "--to", to], prog="fshard") == 1
        err = capsys.readouterr().err
        assert err.startswith("fshard convert: ")
        assert str(tmp_path / "file" / "sub") in err
        assert "Traceback" not in err


def test_a_hugging_face_destination_named_like_a_file_is_refused(dcp_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(
        fshard.CheckpointError, match=r"writes a Hugging Face folder, and .*m\.safetensors names a file"
    ):
        convert(dcp_folder, tmp_path / "m.safetensors", to="hf")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_conversion_to_fshard_leaves_no_new_folder(dcp_folder: Path, tmp_path: Path, monkeypatch) -> None:
    def broken(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_stream, "_write_data", broken)
    with pytest.raises(OSError, match="No space left on device"):
        convert(dcp_folder, tmp_path / "new", to="fshard")
    with pytest.raises(OSError, match="No space left on device"):
        convert(dcp_folder, tmp_path / "a" / "b" / "new", to="fshard")  # the folders above it too
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError, match="No space left on device"):
        convert(dcp_folder, tmp_path / "kept", to="fshard")  # an empty folder that was there stays
    assert list(tmp_path.iterdir()) == [tmp_path / "kept"]


def test_info_names_a_missing_dcp_file(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    (tmp_path / "__0_0.distcp").unlink()
    lines = fshard.checkpoint_info(tmp_path).splitlines()
    assert lines[-2:] == [
        "files: __0_0.distcp (missing)",
        "missing: __0_0.distcp (the metadata names them; fshard.load of their tensors fails)",
    ]


def test_an_interrupted_command_says_so_in_one_line(monkeypatch, capsys) -> None:
    def interrupted(*args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main_convert", interrupted)
    assert cli.main(["convert", "a", "b"], prog="fshard") == 130
    assert capsys.readouterr().err == "fshard: interrupted\n"
