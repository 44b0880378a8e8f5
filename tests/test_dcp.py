"""``fshard.load`` of torch DCP folders in one process: specs, like, bytes entries, and hostile metadata."""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fshard
from fshard._checkpoint import _dcp_pickle, _raw
from fshard._checkpoint._dcp_meta import read_metadata
from fshard._convert import convert

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # complex32 tensors

_G = torch.Generator().manual_seed(3)
DENSE = {
    "model.layer.weight": torch.randn(6, 4, generator=_G).t(),  # stored transposed: strides (1, 4)
    "model.layer.bias": torch.randn(4, generator=_G).to(torch.bfloat16),
    "model.mask": torch.rand(3, 5, generator=_G) > 0.5,
    "model.empty": torch.zeros(0, 3),
    "count": torch.tensor(17),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _state_dict() -> dict[str, object]:
    model = {"layer": {"weight": DENSE["model.layer.weight"], "bias": DENSE["model.layer.bias"]}}
    model |= {"mask": DENSE["model.mask"], "empty": DENSE["model.empty"]}
    return {"model": model, "count": DENSE["count"], "extra": {"lr": 0.5, "names": ["a", "b"]}}


def _save(path: Path, **kwargs: object) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(_state_dict(), checkpoint_id=path, no_dist=True, **kwargs)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("dcp") / "one")


def test_plain_load_returns_every_tensor_and_raw_bytes(saved: Path) -> None:
    out = fshard.load(saved)
    assert sorted(out) == sorted([*DENSE, "extra.lr", "extra.names"])
    assert all(_same(out[k], v) for k, v in DENSE.items())
    lr = out["extra.lr"]
    assert isinstance(lr, bytes)
    assert lr[:4] == b"PK\x03\x04"  # the torch.save stream, as DCP stored it
    assert torch.load(io.BytesIO(lr), weights_only=True) == 0.5  # the caller may unpickle it, fshard does not


@pytest.mark.parametrize(
    "spec",
    [fshard.Chunk(0, [0, 1, 2]), fshard.Chunk(1, [2, 0]), fshard.Replicated([0, 1]), fshard.Single(1)],
    ids=["rows", "cols", "replicated", "single"],
)
def test_a_function_picks_specs_and_skips(saved: Path, spec: object) -> None:
    asked = []

    def specs(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> object:
        asked.append((name, shape, dtype))
        return spec if len(shape) == 2 and shape[0] else None

    out = fshard.load(saved, specs=specs)
    assert sorted(asked) == sorted((k, tuple(v.shape), v.dtype) for k, v in DENSE.items())
    assert sorted(out) == ["model.layer.weight", "model.mask"]
    for name, x in out.items():
        assert x.layout == spec.layout(tuple(DENSE[name].shape))  # type: ignore[attr-defined]
        assert _same(fshard.gather(x), DENSE[name])


def test_a_mapping_names_what_to_load(saved: Path) -> None:
    grid = fshard.Named(fshard.Mesh((2, 2)), ("x", "y"))
    out = fshard.load(saved, specs={"model.layer.weight": grid, "count": fshard.Replicated([0, 3]), "extra.lr": None})
    assert sorted(out) == ["count", "extra.lr", "model.layer.weight"]
    assert out["model.layer.weight"].layout == grid.layout((4, 6))
    assert [s.data.tolist() for s in out["count"].addressable_shards] == [17, 17]
    assert _same(fshard.gather(out["model.layer.weight"]), DENSE["model.layer.weight"])
    assert isinstance(out["extra.lr"], bytes)


def test_one_spec_for_every_tensor(saved: Path) -> None:
    out = fshard.load(saved, specs=fshard.Replicated([0, 1]))
    assert sorted(out) == sorted(DENSE)  # bytes entries only come when asked for
    assert all(_same(fshard.gather(out[k]), v) for k, v in DENSE.items())


def test_like_gives_layouts_tensors_and_requires_grad(saved: Path) -> None:
    like = {
        "model.layer.bias": fshard.zeros(fshard.Chunk(0, [1, 0]), 4, dtype=torch.bfloat16, requires_grad=True),
        "model.mask": torch.zeros(3, 5, dtype=torch.bool),
    }
    out = fshard.load(saved, like=like)
    assert out["model.layer.bias"].layout == like["model.layer.bias"].layout
    assert out["model.layer.bias"].requires_grad
    assert _same(fshard.gather(out["model.layer.bias"]).detach(), DENSE["model.layer.bias"])
    assert _same(out["model.mask"], DENSE["model.mask"])


def test_safetensors_serialization_reads_too(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    tensors = {k: v for k, v in DENSE.items() if k != "model.empty"}
    writer = FileSystemWriter(tmp_path / "st", serialization_format=SerializationFormat.SAFETENSORS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: v.contiguous() for k, v in tensors.items()}, storage_writer=writer, no_dist=True)
    out = fshard.load(tmp_path / "st", specs=lambda name, shape, dtype: fshard.Replicated([0, 1]))
    assert all(_same(fshard.gather(out[k]), v) for k, v in tensors.items())


def test_safetensors_serialization_with_non_tensor_entries_reads_too(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    tensors = {k: v.contiguous() for k, v in DENSE.items() if k != "model.empty"}
    writer = FileSystemWriter(tmp_path / "st", serialization_format=SerializationFormat.SAFETENSORS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-tensor entries come first in the file, the safetensors part after
        dcp.save({**tensors, "extra": {"lr": 0.5}}, storage_writer=writer, no_dist=True)
    out = fshard.load(tmp_path / "st", specs=lambda name, shape, dtype: fshard.Chunk(0, [0, 1]) if shape else None)
    assert all(_same(fshard.gather(out[k]), v) for k, v in tensors.items() if v.dim())
    assert torch.load(io.BytesIO(fshard.load(tmp_path / "st")["extra.lr"]), weights_only=True) == 0.5


def _views() -> dict[str, torch.Tensor]:
    """Tensors with torch's lazy negative and conjugate bits, which ``torch.save`` keeps unresolved."""
    z = torch.randn(6, 4, dtype=torch.complex64, generator=_G)
    return {
        "conj": z.conj(),
        "conj_t": z.t().conj(),  # transposed strides too
        "neg": torch._neg_view(torch.randn(6, 5, generator=_G)),
        "neg_bf16": torch._neg_view(torch.randn(3, 4, generator=_G).to(torch.bfloat16)),
        "neg_conj": torch._neg_view(z.conj()),
        "conj_chalf": z.to(torch.complex32).conj(),
        "neg_chalf": torch._neg_view(z.to(torch.complex32)),
        "neg_i32": torch._neg_view(torch.tensor([[1, -2, -(2**31)]], dtype=torch.int32)),
    }


def _saved_views(path: Path, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Saves ``views`` with DCP; returns what torch's ``dcp.load`` reads back."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(views, checkpoint_id=path, no_dist=True)
        back = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in views.items()}
        dcp.load(back, checkpoint_id=path, no_dist=True)
    assert all(_same(back[k], v.resolve_conj().resolve_neg()) for k, v in views.items())
    return back


def test_negated_and_conjugated_views_load_as_torch_loads_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    back = _saved_views(tmp_path / "views", _views())
    assert all(_same(v, back[k]) for k, v in fshard.load(tmp_path / "views").items())
    rows = fshard.load(tmp_path / "views", specs=fshard.Chunk(0, [0, 1]))  # each rank reads a part of the chunk
    assert all(_same(fshard.gather(v), back[k]) for k, v in rows.items())
    monkeypatch.setattr(_raw, "BLOCK", 8)  # through 8-byte buffers, box by box
    cols = fshard.load(tmp_path / "views", specs=fshard.Chunk(1, [0, 1, 2]))
    assert all(_same(fshard.gather(v), back[k]) for k, v in cols.items())


def test_convert_writes_the_values_of_negated_and_conjugated_views(tmp_path: Path) -> None:
    views = {k: v for k, v in _views().items() if "chalf" not in k}  # fshard checkpoints store no complex32
    back = _saved_views(tmp_path / "views", views)
    convert(tmp_path / "views", tmp_path / "converted")
    out = fshard.load(tmp_path / "converted")
    assert sorted(out) == sorted(views)
    assert all(_same(v, back[k]) for k, v in out.items())


def test_small_read_buffers_give_the_same_values(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_raw, "BLOCK", 8)  # every read goes through 8-byte buffers, box by box
    out = fshard.load(saved, specs={"model.layer.weight": fshard.Chunk(1, [0, 1, 2, 3])})
    assert _same(fshard.gather(out["model.layer.weight"]), DENSE["model.layer.weight"])


# -- the metadata is read by an allow-list ------------------------------------------------------------


class _Recording(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.names: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> object:
        self.names.add((module, name))
        return super().find_class(module, name)


def test_the_allow_list_covers_what_dcp_writes(saved: Path) -> None:
    recording = _Recording((saved / ".metadata").read_bytes())
    recording.load()
    assert recording.names <= _dcp_pickle.ALLOWED
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in recording.names
    assert [e.name for e in read_metadata(saved).tensors] == [k for k in fshard.load(saved) if k in DENSE]


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


class _Evals:
    def __reduce__(self) -> tuple[object, ...]:
        return (eval, ("__import__('os').getpid()",))


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ("system", f"{os.system.__module__}.system"),
        ("eval", "builtins.eval"),
        ("nested", f"{os.system.__module__}.system"),
    ],
)
def test_metadata_that_would_run_code_is_refused_and_nothing_runs(
    saved: Path, tmp_path: Path, payload: str, named: str
) -> None:
    folder = tmp_path / "evil"
    shutil.copytree(saved, folder)
    marker = tmp_path / "ran"
    obj = {"system": _RunsCode(marker), "eval": _Evals(), "nested": {"state_dict_metadata": [_RunsCode(marker)]}}
    (folder / ".metadata").write_bytes(pickle.dumps(obj[payload]))
    with pytest.raises(fshard.CheckpointError, match=re.escape(f"names {named}, which torch.distributed.checkpoint")):
        fshard.load(folder)
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(_RunsCode(marker))) == 0  # the same payload does run through plain pickle
    assert marker.exists()


def test_a_dcp_class_name_cannot_reach_other_attributes(saved: Path, tmp_path: Path) -> None:
    folder = tmp_path / "evil"
    shutil.copytree(saved, folder)
    # protocol 4 resolves dotted names: Metadata.__init__.__globals__ would lead anywhere
    data = b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x94\x8c\x11Metadata.__init__\x94\x93\x94."
    (folder / ".metadata").write_bytes(data)
    with pytest.raises(
        fshard.CheckpointError, match=re.escape("names torch.distributed.checkpoint.metadata.Metadata.__init__")
    ):
        fshard.load(folder)


# -- errors ---------------------------------------------------------------------------------------------


def _copy(saved: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(saved, folder)
    return folder


def test_errors_name_the_problem(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(fshard.CheckpointError, match=re.escape("names ['model.layer.wieght'], which DCP folder")):
        fshard.load(saved, specs={"model.layer.wieght": fshard.Chunk(0, [0])})
    with pytest.raises(fshard.CheckpointError, match=re.escape("(close: ['model.layer.weight', 'model.layer.bias'])")):
        fshard.load(saved, specs={"model.layer.wieght": fshard.Chunk(0, [0])})
    with pytest.raises(fshard.CheckpointError, match=re.escape("'model.mask' has shape (3, 5) and dtype torch.bool")):
        fshard.load(saved, like={"model.mask": torch.zeros(3, 5)})
    with pytest.raises(fshard.CheckpointError, match=re.escape("'extra.lr' of DCP folder")):
        fshard.load(saved, specs={"extra.lr": fshard.Chunk(0, [0])})
    with pytest.raises(TypeError, match=re.escape("takes a mapping of its names")):
        fshard.load(saved, like=[torch.zeros(1)])
    with pytest.raises(fshard.SpecError, match=re.escape("checkpoint holds values, not summands")):
        fshard.load(saved, specs={"count": fshard.Partial(fshard.Replicated([0, 1]))})


def test_a_truncated_data_file_is_named(saved: Path, tmp_path: Path) -> None:
    folder = _copy(saved, tmp_path)
    data = folder / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(fshard.CheckpointError, match=r"DCP file .*__0_0\.distcp has \d+ bytes, but chunk .* truncated"):
        fshard.load(folder)


def test_damaged_chunk_bytes_are_refused(saved: Path, tmp_path: Path) -> None:
    folder = _copy(saved, tmp_path)
    md = read_metadata(folder)
    chunk = md.tensors[0].chunks[0]
    data = bytearray((folder / chunk.file).read_bytes())
    data[chunk.offset : chunk.offset + 4] = b"XXXX"  # neither a torch.save archive nor a safetensors file
    (folder / chunk.file).write_bytes(bytes(data))
    damaged = r"chunk .* starts as neither a torch.save archive \(a zip\) nor a safetensors file .* the file is damaged"
    with pytest.raises(fshard.CheckpointError, match=damaged):
        fshard.load(folder, specs={md.tensors[0].name: fshard.Chunk(0, [0])})


def test_stored_transforms_are_refused(saved: Path, tmp_path: Path) -> None:
    folder = _copy(saved, tmp_path)
    text = (folder / ".metadata").read_bytes()
    md = pickle.loads(text)
    for info in md.storage_data.values():
        info.transform_descriptors = ["zstd"]
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(fshard.CheckpointError, match=re.escape("was stored through transforms ['zstd']")):
        fshard.load(folder)


def test_chunks_that_leave_a_gap_are_refused(saved: Path, tmp_path: Path) -> None:
    folder = _copy(saved, tmp_path)
    md = pickle.loads((folder / ".metadata").read_bytes())
    md.state_dict_metadata["model.mask"].chunks[0].sizes = torch.Size([2, 5])
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(
        fshard.CheckpointError, match=re.escape("the chunks of entry 'model.mask' do not tile its shape (3, 5)")
    ):
        fshard.load(folder)


def test_a_path_outside_the_folder_is_refused(saved: Path, tmp_path: Path) -> None:
    folder = _copy(saved, tmp_path)
    md = pickle.loads((folder / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(
        fshard.CheckpointError, match=re.escape("relative_path is '../elsewhere.distcp', expected a file name")
    ):
        fshard.load(folder)
