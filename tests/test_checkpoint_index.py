"""``index.json`` cannot be silently wrong: a digest of its content, and a strict schema checked before allocating.

Edits that keep the digest are caught by it; edits that recompute it (as a
deliberate writer would) are caught by the schema, which names the field. Either
way ``load`` and ``checkpoint_info`` raise ``CheckpointError`` and nothing else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fshard
from fshard._checkpoint._format import index_digest

ALL = [0, 1, 2, 3]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    x = fshard.shard(torch.arange(120.0).reshape(10, 12), fshard.Chunk(0, ALL))
    fshard.save(tmp_path, {"x": x, "step": 100, "b": torch.ones(3), "lr": 0.5})
    return tmp_path


def _index(root: Path) -> dict[str, Any]:
    return json.loads((root / "index.json").read_text())


def _write(root: Path, index: dict[str, Any], redigest: bool) -> None:
    if redigest:
        index["digest"] = index_digest(index)
    (root / "index.json").write_text(json.dumps(index, indent=1))


def _edit(root: Path, change: Callable[[dict[str, Any]], Any], redigest: bool) -> None:
    index = _index(root)
    change(index)
    _write(root, index, redigest)


def _both_raise(root: Path, message: str) -> None:
    for read in (fshard.load, fshard.checkpoint_info):
        with pytest.raises(fshard.CheckpointError, match=message):
            read(root)


def _leaf(index: dict[str, Any], path: str) -> dict[str, Any]:
    return next(r for r in index["leaves"] if r["path"] == path)


def _set_scalar(index: dict[str, Any]) -> None:
    _leaf(index, "['step']")["value"] = 999


def _rename_key(index: dict[str, Any]) -> None:
    index["tree"]["dict"][1][0] = "epoch"
    _leaf(index, "['step']")["path"] = "['epoch']"


def _change_kind(index: dict[str, Any]) -> None:
    record = _leaf(index, "['x']")
    record["kind"] = "tensor"
    del record["layout"]


EDITS = {"scalar-100-to-999": _set_scalar, "renamed-key": _rename_key, "kind": _change_kind}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_index_does_not_match_its_digest(saved, edit):
    _edit(saved, EDITS[edit], redigest=False)
    _both_raise(saved, r"index\.json does not match its digest .* edited or damaged after the save")


def test_an_edit_with_a_new_digest_loads_as_edited(saved):
    _edit(saved, _set_scalar, redigest=True)  # a deliberate writer: the digest guards against accidents, not intent
    assert fshard.load(saved)["step"] == 999


def test_a_format_1_index_without_digest_still_loads(saved):
    index = _index(saved)
    del index["digest"]
    index["version"] = 1
    _write(saved, index, redigest=False)
    assert fshard.load(saved)["step"] == 100
    assert "(format 1)" in fshard.checkpoint_info(saved)


def _shape(value: Any) -> Callable[[dict[str, Any]], None]:
    def change(index: dict[str, Any]) -> None:
        _leaf(index, "['x']")["shape"][0] = value

    return change


def _huge(index: dict[str, Any]) -> None:
    """The shape, layout and boxes of ['x'] all say 2**45 x 2**20 floats (128 PiB): consistent, but not in the files."""
    record = _leaf(index, "['x']")
    record["shape"] = record["layout"]["shape"] = [2**45, 2**20]
    record["layout"]["shards"] = [{"offsets": [0, 0], "sizes": [2**45, 2**20], "placement": "rank:0/cpu"}]
    record["boxes"] = [record["boxes"][0] | {"offsets": [0, 0], "sizes": [2**45, 2**20]}]


def _deep(levels: int) -> Callable[[dict[str, Any]], None]:
    def change(index: dict[str, Any]) -> None:
        node: dict[str, Any] = {"leaf": 1}
        path = "['step']"
        for _ in range(levels):
            node = {"list": [node]}
            path += "[0]"
        index["tree"]["dict"][1][1] = node
        _leaf(index, "['step']")["path"] = path

    return change


def _tree_leaf_twice(index: dict[str, Any]) -> None:
    index["tree"]["dict"][1][1] = {"leaf": 0}


def _del(field: str, path: str = "['x']") -> Callable[[dict[str, Any]], None]:
    return lambda index: _leaf(index, path).pop(field)


def _set(field: str, value: Any, path: str = "['x']") -> Callable[[dict[str, Any]], None]:
    return lambda index: _leaf(index, path).__setitem__(field, value)


def _box(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda index: _leaf(index, "['x']")["boxes"][1].__setitem__(field, value)


def _shard(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda index: _leaf(index, "['x']")["layout"]["shards"][2].__setitem__(field, value)


SCHEMA = {
    # raw KeyError before
    "missing-dtype": (_del("dtype"), r"leaves\[0\] has keys .* missing \['dtype'\]"),
    "missing-boxes": (_del("boxes"), r"leaves\[0\] has keys .* missing \['boxes'\]"),
    "missing-files": (lambda i: i.pop("files"), r"top-level keys are .* format 2 has"),
    # raw TypeError before
    "leaves-not-a-list": (lambda i: i.__setitem__("leaves", {"a": 1}), r"leaves is an object .*expected a list"),
    "shape-null": (_shape(None), r"leaves\[0\]\.shape\[0\] is null None, expected an int"),
    "box-not-an-object": (lambda i: _leaf(i, "['x']")["boxes"].__setitem__(0, 7), r"leaves\[0\]\.boxes\[0\] is an int"),
    # converted silently before
    "shape-as-string": (_shape("10"), r"leaves\[0\]\.shape\[0\] is a string '10', expected an int"),
    "shape-as-float": (_shape(6.7), r"leaves\[0\]\.shape\[0\] is a float 6\.7, expected an int"),
    "shape-as-bool": (_shape(True), r"leaves\[0\]\.shape\[0\] is a bool True, expected an int"),
    "scalar-type": (_set("value", "100", "['step']"), r"leaves\[1\]\.value is a string '100', expected a JSON int"),
    "float-not-a-repr": (_set("value", " 0.5", "['lr']"), r"leaves\[3\]\.value is ' 0\.5', not the repr of a float"),
    # OverflowError before
    "shape-past-int64": (_shape(2**70), r"leaves\[0\]\.shape\[0\] is 1180591620717411303424, outside \[0, 9223"),
    # MemoryError before: a consistent but enormous leaf
    "huge-leaf": (
        _huge,
        r"files\['rank-00000\.safetensors'\]\.bytes is \d+, but the boxes in that file need 147573952589676412928 ",
    ),
    # RecursionError before
    "tree-too-deep": (_deep(150), r"tree\.dict\[1\]\[1\](\.list\[0\]){100} nests deeper than 100 levels"),
    # structure
    "leaf-named-twice": (_tree_leaf_twice, r"tree\.dict\[1\]\[1\]\.leaf names leaf 0 a second time"),
    "unknown-kind": (_set("kind", "blob"), r"leaves\[0\]\.kind is 'blob', expected 'scalar', 'tensor' or 'array'"),
    "extra-key": (_set("note", 1), r"leaves\[0\] has keys .* unexpected \['note'\]"),
    "wrong-path": (_set("path", "['y']"), r"leaves\[0\]\.path is \"\['y'\]\", but the tree places this leaf at"),
    "dtype": (_set("dtype", "float128"), r"leaves\[0\]\.dtype is 'float128', expected one of"),
    "box-file": (_box("file", "rank-00009.safetensors"), r"leaves\[0\]\.boxes\[1\]\.file is 'rank-00009\.safetensors'"),
    "box-sha": (_box("sha256", "xyz"), r"leaves\[0\]\.boxes\[1\]\.sha256 is not 64 lowercase hex digits"),
    "box-outside": (_box("offsets", [9, 0]), r"leaves\[0\]\.boxes\[1\] runs past the shape \(10, 12\) in dim 0"),
    "box-gap": (_box("offsets", [4, 0]), r"leaves\[0\]\.boxes do not tile the shape \(10, 12\)"),
    "box-empty": (_box("sizes", [0, 12]), r"leaves\[0\]\.boxes\[1\]\.sizes\[0\] is 0, outside \[1, "),
    "layout-placement": (_shard("placement", "worker2"), r"leaves\[0\]\.layout\.shards\[2\]\.placement is 'worker2'"),
    "layout-overlap": (_shard("offsets", [2, 0]), r"leaves\[0\]\.layout is not a valid layout \(Shards"),
    "layout-partial": (
        lambda i: _leaf(i, "['x']")["layout"].__setitem__("partial", "sum"),
        r"leaves\[0\]\.layout has keys .* unexpected \['partial'\]",
    ),
    "file-rank": (
        lambda i: i["files"]["rank-00001.safetensors"].__setitem__("rank", 3),
        r"files\['rank-00001\.safetensors'\]\.rank is 3, but the file name says rank 1",
    ),
    "version-true": (lambda i: i.__setitem__("version", True), r"format version True"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA))
def test_a_malformed_index_names_the_field(saved, case):
    change, message = SCHEMA[case]
    _edit(saved, change, redigest=True)
    _both_raise(saved, message)


def test_a_float_shape_past_any_int_is_named_and_cannot_be_digested(saved):
    index = _index(saved)
    _leaf(index, "['x']")["shape"][0] = 1e400  # JSON Infinity: int() of it raised OverflowError before
    _write(saved, index, redigest=False)
    _both_raise(saved, r"cannot be put in canonical form \(Out of range float values")
    del index["digest"]
    index["version"] = 1  # no digest in format 1: the schema catches it
    _write(saved, index, redigest=False)
    _both_raise(saved, r"leaves\[0\]\.shape\[0\] is a float inf, expected an int")


def test_json_nested_past_the_parser_is_a_checkpoint_error(saved):
    (saved / "index.json").write_text('{"format": "fshard-checkpoint", "tree": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _both_raise(saved, re.escape("is not valid JSON (maximum recursion depth exceeded"))


def test_ints_too_long_to_parse_are_a_checkpoint_error(saved):
    (saved / "index.json").write_text('{"version": ' + "9" * 5000 + "}")
    _both_raise(saved, "is not valid JSON")
