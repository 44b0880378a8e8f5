"""Lying, truncated, oversized and malformed Hugging Face checkpoints: each raises CheckpointError before any read.

Every case starts from one valid file (``w``: float32 2x3, ``b``: int64 2) and breaks one
thing. The error names the file and, where one tensor is at fault, the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import fshard
from fshard._checkpoint import _safetensors

SPEC = fshard.Replicated([0, 1])
W = torch.arange(6, dtype=torch.float32).reshape(2, 3)
B = torch.tensor([7, 8], dtype=torch.int64)
DATA = W.numpy().tobytes() + B.numpy().tobytes()


def _header(**changes: Any) -> dict[str, Any]:
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]},
    }
    for key, value in changes.items():
        if value is None:
            del header[key]
        elif key in ("w", "b") and isinstance(value, dict):
            header[key] = {**header[key], **value}
        else:
            header[key] = value
    return header


def _write(
    path: Path, header: Any = None, data: bytes = DATA, length: int | None = None, raw: bytes | None = None
) -> Path:
    text = raw if raw is not None else json.dumps(_header() if header is None else header).encode()
    n = len(text) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + text + data)
    return path


def _tensor_info_without(field: str) -> dict[str, Any]:
    info = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    del info[field]
    return info


# (id, how to break the file, the phrase the error must hold). ``{f}`` is the file's path.
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("empty-file", {"raw_file": b""}, "{f}: has 0 bytes, fewer than the 8 of a header length"),
    ("short-file", {"raw_file": b"\x01\x00"}, "{f}: has 2 bytes, fewer than the 8"),
    ("header-over-limit", {"length": 100_000_001}, "declares a header of 100000001 bytes, over the limit of 100000000"),
    ("header-length-2**63", {"length": 2**63}, f"declares a header of {2**63} bytes, over the limit"),
    ("header-past-end", {"length": 10_000}, "declares a header of 10000 bytes but holds"),
    ("header-not-object", {"raw": b"[1, 2]"}, "does not start with '{'"),
    ("header-not-utf8", {"raw": b'{"w\xff": 1}'}, "is not valid JSON"),
    ("header-not-json", {"raw": b"{not json}"}, "is not valid JSON"),
    ("header-nan", {"raw": b'{"w": NaN}'}, "is not valid JSON (NaN is not JSON"),
    ("header-deep", {"raw": b"{" + b'"a":[' * 100_000 + b"]" * 100_000 + b"}"}, "is not valid JSON"),
    ("duplicate-key", {"raw": b'{"w": {}, "w": {}}'}, "duplicate key 'w'"),
    ("metadata-not-strings", {"header": _header(__metadata__={"format": 1})}, "has __metadata__"),
    ("metadata-not-object", {"header": _header(__metadata__=["pt"])}, "has __metadata__"),
    ("info-not-object", {"header": _header(w=[1, 2])}, "tensor 'w' is described by list"),
    (
        "info-extra-field",
        {"header": _header(w={"extra": 1})},
        "tensor 'w' is described by ['data_offsets', 'dtype', 'extra', 'shape']",
    ),
    (
        "info-missing-field",
        {"header": _header(w=None) | {"w": _tensor_info_without("shape")}},
        "tensor 'w' is described by ['data_offsets', 'dtype']",
    ),
    (
        "unknown-dtype",
        {"header": _header(w={"dtype": "F128"})},
        "tensor 'w' has dtype 'F128', which fshard does not read",
    ),
    ("dtype-not-str", {"header": _header(w={"dtype": 4})}, "tensor 'w' has dtype 4"),
    (
        "shape-negative",
        {"header": _header(w={"shape": [-2, -3]})},
        "tensor 'w' has shape [-2, -3], not a list of non-negative ints",
    ),
    ("shape-float", {"header": _header(w={"shape": [2.0, 3]})}, "tensor 'w' has shape [2.0, 3]"),
    ("shape-bool", {"header": _header(w={"shape": [True, 6]})}, "tensor 'w' has shape [True, 6]"),
    ("shape-not-list", {"header": _header(w={"shape": 6})}, "tensor 'w' has shape 6"),
    (
        "offsets-three",
        {"header": _header(w={"data_offsets": [0, 12, 24]})},
        "tensor 'w' has data_offsets [0, 12, 24], not two",
    ),
    ("offsets-negative", {"header": _header(w={"data_offsets": [-24, 0]})}, "tensor 'w' has data_offsets [-24, 0]"),
    (
        "offsets-reversed",
        {"header": _header(w={"data_offsets": [24, 0]})},
        "tensor 'w' has data_offsets [24, 0], which end before they begin",
    ),
    (
        "bytes-not-shape",
        {"header": _header(w={"shape": [2, 2]})},
        "tensor 'w' is F32 of shape [2, 2]: 16 bytes, but its data_offsets hold 24",
    ),
    (
        "huge-shape",
        {"header": _header(w={"shape": [2**40, 2**40]})},
        f"tensor 'w' is F32 of shape [{2**40}, {2**40}]: {2**82} bytes",
    ),
    (
        "overlap",
        {"header": _header(b={"data_offsets": [16, 32]}), "data": DATA[:32]},
        "tensor 'b' (bytes 16 to 32) overlaps tensor 'w'",
    ),
    (
        "gap",
        {"header": _header(b={"data_offsets": [32, 48]}), "data": DATA + bytes(8)},
        "bytes 24 to 32 of the data belong to no tensor (before 'b')",
    ),
    ("truncated-data", {"data": DATA[:30]}, "tensor 'b' ends at byte"),
    (
        "offsets-past-end",
        {"header": _header(b={"data_offsets": [2**60, 2**60 + 16]})},
        "belong to no tensor (before 'b')",
    ),
    ("trailing-bytes", {"data": DATA + b"junk"}, "holds 4 bytes after the last tensor's data"),
]


@pytest.mark.parametrize(("breaks", "phrase"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_broken_file_raises_naming_file_and_tensor(tmp_path: Path, breaks: dict[str, Any], phrase: str) -> None:
    path = tmp_path / "model.safetensors"
    if "raw_file" in breaks:
        path.write_bytes(breaks["raw_file"])
    else:
        _write(path, breaks.get("header"), breaks.get("data", DATA), breaks.get("length"), breaks.get("raw"))
    _safetensors.counters.reset()
    with pytest.raises(
        fshard.CheckpointError, match=re.escape(phrase.replace("{f}", f"Safetensors file {path}"))
    ) as info:
        fshard.load(path, specs=SPEC)
    assert f"Safetensors file {path}" in str(info.value)
    assert _safetensors.counters.bytes_read == 0  # refused before any data was read
    with pytest.raises(fshard.CheckpointError):  # the same error for the file in a folder
        fshard.load(tmp_path, specs=SPEC)


def test_the_untouched_file_is_valid_for_safetensors_and_fshard(tmp_path: Path) -> None:
    path = _write(tmp_path / "model.safetensors")
    assert load_file(path)["w"].equal(W)
    out = fshard.load(path, specs=SPEC)
    assert fshard.gather(out["w"]).equal(W)
    assert fshard.gather(out["b"]).equal(B)


def test_nothing_is_allocated_from_an_unchecked_header_length(tmp_path: Path) -> None:
    import tracemalloc

    path = _write(tmp_path / "model.safetensors", length=99_999_999)  # under the limit, past the end of the file
    tracemalloc.start()
    try:
        with pytest.raises(fshard.CheckpointError, match="declares a header of 99999999 bytes but holds"):
            fshard.load(path, specs=SPEC)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20


# -- folders: the index is untrusted input too ------------------------------------------------------


SHARD = "model-00001-of-00001.safetensors"  # a sharded save's file: model.safetensors would be read alone


def _index(folder: Path, weight_map: Any, **extra: Any) -> None:
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map, **extra})
    )


INDEX_CASES: list[tuple[str, Any, str]] = [
    (
        "parent-path",
        {"w": f"../{SHARD}", "b": SHARD},
        f"puts tensor 'w' in '../{SHARD}', which is not the plain name",
    ),
    (
        "absolute-path",
        {"w": f"/etc/{SHARD}", "b": SHARD},
        f"puts tensor 'w' in '/etc/{SHARD}'",
    ),
    ("not-safetensors", {"w": "model.bin", "b": SHARD}, "puts tensor 'w' in 'model.bin'"),
    ("tensor-not-in-file", {"w": SHARD, "x": SHARD}, "puts tensor 'x' in "),
    ("missing-file", {"w": "model-2.safetensors"}, "model-2.safetensors: does not exist"),
    ("map-not-object", ["w"], "has no 'weight_map' object"),
    ("map-values-not-str", {"w": 3}, "has no 'weight_map' object"),
]


@pytest.mark.parametrize(("weight_map", "phrase"), [c[1:] for c in INDEX_CASES], ids=[c[0] for c in INDEX_CASES])
def test_a_lying_index_raises(tmp_path: Path, weight_map: Any, phrase: str) -> None:
    _write(tmp_path / SHARD)
    _index(tmp_path, weight_map)
    with pytest.raises(fshard.CheckpointError, match=re.escape(phrase)):
        fshard.load(tmp_path, specs=SPEC)


def test_an_index_that_is_not_json_raises(tmp_path: Path) -> None:
    _write(tmp_path / SHARD)
    (tmp_path / "model.safetensors.index.json").write_text("{weight_map")
    with pytest.raises(
        fshard.CheckpointError, match=re.escape(f"{tmp_path / 'model.safetensors.index.json'} is not valid JSON")
    ):
        fshard.load(tmp_path, specs=SPEC)


def test_an_oversized_index_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fshard._checkpoint import _hf_files

    monkeypatch.setattr(_hf_files, "MAX_HEADER", 16)
    _write(tmp_path / SHARD)
    _index(tmp_path, {"w": SHARD, "b": SHARD})
    with pytest.raises(fshard.CheckpointError, match="is over 16 bytes: it is no index that fshard reads"):
        fshard.load(tmp_path, specs=SPEC)


def test_a_tensor_in_two_files_of_a_folder_without_index_raises(tmp_path: Path) -> None:
    _write(tmp_path / "a.safetensors")
    _write(tmp_path / "b.safetensors")
    with pytest.raises(fshard.CheckpointError, match=re.escape("Tensor 'w' is in both")):
        fshard.load(tmp_path, specs=SPEC)


def test_a_file_truncated_after_its_header_was_read_raises(tmp_path: Path) -> None:
    path = _write(tmp_path / "model.safetensors")

    def spec_and_truncate(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        with open(path, "r+b") as f:  # the headers were checked; the data goes before it is read
            f.truncate(path.stat().st_size - 8)
        return SPEC

    with pytest.raises(
        fshard.CheckpointError, match=re.escape(f"Safetensors file {path} changed since its header was read")
    ):
        fshard.load(path, specs=spec_and_truncate)


@pytest.mark.parametrize("reader", [fshard.load, fshard.checkpoint_info], ids=["load", "checkpoint_info"])
def test_a_dtype_fshard_does_not_read_is_named_not_called_malformed(tmp_path: Path, reader: Any) -> None:
    """safetensors writes float8_e8m0fnu validly: both readers name its dtype (checkpoint_info said "malformed")."""
    from safetensors.torch import save_file

    path = tmp_path / "e8m0.safetensors"
    save_file({"x": torch.zeros(4, dtype=torch.uint8).view(torch.float8_e8m0fnu)}, path)
    with pytest.raises(fshard.CheckpointError, match=re.escape("has dtype 'F8_E8M0', which fshard does not read")):
        reader(path)
