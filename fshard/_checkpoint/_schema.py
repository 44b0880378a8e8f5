"""Checking ``index.json`` field by field before anything is allocated from it.

Every value is checked for its exact JSON type (a shape of ``"6"`` or ``6.7`` is
refused, not converted), ints for their range, records for their exact keys, the
tree for depth and for naming each leaf once, and every leaf's boxes for tiling
its shape within the bytes its files hold. A problem raises ``CheckpointError``
naming the field, as ``leaves[3].shape[1]``; nothing else escapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeGuard, cast

from fshard._checkpoint._format import DTYPES, FILE_RE, INDEX, MAX_DEPTH, Saved
from fshard._errors import CheckpointError, FShardError
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.placement import Placement
from fshard._layout.validate import MAX_EXTENT

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SCALAR_TYPES = {"bool": bool, "int": int, "float": str, "str": str, "NoneType": type(None)}


class _Bad(Exception):
    """One malformed field: its place in the index and what is wrong there."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")


def _json_type(value: object) -> str:
    names: dict[type[object], str] = {
        bool: "a bool",
        int: "an int",
        float: "a float",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    return names.get(type(value), "null" if value is None else type(value).__name__)


# The exact-type checks, telling the type checker what parsed JSON holds: string keys, any values.
def _is_object(value: Any) -> TypeGuard[dict[str, Any]]:
    return type(value) is dict


def _is_list(value: Any) -> TypeGuard[list[Any]]:
    return type(value) is list


def _object(value: Any, field: str, keys: set[str], optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not _is_object(value):
        raise _Bad(field, f"is {_json_type(value)}, expected an object with keys {sorted(keys)}")
    missing, extra = keys - set(value), set(value) - keys - optional
    if missing or extra:
        raise _Bad(field, f"has keys {sorted(value)}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    return value


def _list(value: Any, field: str) -> list[Any]:
    if not _is_list(value):
        raise _Bad(field, f"is {_json_type(value)} {_short(value)}, expected a list")
    return value


def _int(value: Any, field: str, low: int = 0, high: int = MAX_EXTENT) -> int:
    if type(value) is not int:
        raise _Bad(field, f"is {_json_type(value)} {_short(value)}, expected an int")
    if not low <= value <= high:
        raise _Bad(field, f"is {_short(value)}, outside [{low}, {high}]")
    return value


def _str(value: Any, field: str) -> str:
    if type(value) is not str:
        raise _Bad(field, f"is {_json_type(value)} {_short(value)}, expected a string")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _ints(value: Any, field: str, length: int, low: int = 0) -> tuple[int, ...]:
    items = _list(value, field)
    if len(items) != length:
        raise _Bad(field, f"has {len(items)} entries, expected {length} (one per dimension)")
    return tuple(_int(v, f"{field}[{k}]", low) for k, v in enumerate(items))


def saved_leaves(root: Path, index: dict[str, Any]) -> list[Saved]:
    """Every leaf of ``index`` (whose top-level keys are checked), checked and parsed.

    Raises:
        CheckpointError: naming the first malformed field.
    """
    try:
        files = _files(index["files"])
        leaves = _list(index["leaves"], "leaves")
        paths = _tree_paths(index["tree"], len(leaves))
        saved = [_leaf(r, f"leaves[{i}]", paths[i], files) for i, r in enumerate(leaves)]
        _check_budget(saved, files)
    except _Bad as exc:
        msg = f"{root / INDEX} is malformed: {exc}. The checkpoint index is damaged: restore it or re-save."
        raise CheckpointError(msg) from None
    return saved


def _files(value: Any) -> dict[str, int]:
    """File name -> size in bytes."""
    if not _is_object(value):
        raise _Bad("files", f"is {_json_type(value)}, expected an object")
    out: dict[str, int] = {}
    for name, record in value.items():
        field = f"files[{name!r}]"
        if not FILE_RE.match(name):
            raise _Bad(field, "is not a file name of the form 'rank-NNNNN.safetensors'")
        record = _object(record, field, {"rank", "bytes"})
        named = int(name.removeprefix("rank-").removesuffix(".safetensors"))
        if _int(record["rank"], f"{field}.rank") != named:
            raise _Bad(f"{field}.rank", f"is {record['rank']}, but the file name says rank {named}")
        out[name] = _int(record["bytes"], f"{field}.bytes")
    return out


def _tree_paths(tree: Any, n_leaves: int) -> list[str]:
    """The path of each leaf index, checking the tree (iteratively: its depth is bounded, not recursed)."""
    paths: list[str | None] = [None] * n_leaves
    for node, path, field, depth in _nodes(tree):
        if depth > MAX_DEPTH:
            raise _Bad(field, f"nests deeper than {MAX_DEPTH} levels")
        if "leaf" in node:
            if not n_leaves:
                raise _Bad(f"{field}.leaf", "names a leaf, but 'leaves' is empty")
            i = _int(node["leaf"], f"{field}.leaf", 0, n_leaves - 1)
            if paths[i] is not None:
                raise _Bad(f"{field}.leaf", f"names leaf {i} a second time")
            paths[i] = path
    unnamed = [i for i, p in enumerate(paths) if p is None]
    if unnamed:
        raise _Bad("tree", f"does not name leaves {unnamed[:5]}")
    return [p for p in paths if p is not None]


def _nodes(tree: Any) -> Iterator[tuple[dict[str, Any], str, str, int]]:
    """Each node of the tree as (node, leaf path, field in the index, depth), parents first."""
    stack = [(tree, "", "tree", 0)]
    while stack:
        node, path, field, depth = stack.pop()
        if not _is_object(node) or len(node) != 1 or next(iter(node)) not in ("leaf", "dict", "list", "tuple"):
            raise _Bad(field, "is not one of {'leaf': i}, {'dict': [...]}, {'list': [...]}, {'tuple': [...]}")
        yield node, path, field, depth
        kind = next(iter(node))
        children = _list(node[kind], f"{field}.{kind}") if kind != "leaf" else []
        entries: list[tuple[Any, str, str, int]] = []
        if kind == "dict":
            seen: set[Any] = set()
            for k, entry in enumerate(children):
                if not _is_list(entry) or len(entry) != 2 or type(entry[0]) not in (str, int):
                    raise _Bad(f"{field}.dict[{k}]", "is not a [key, node] pair with a string or int key")
                if (type(entry[0]), entry[0]) in seen:
                    raise _Bad(f"{field}.dict[{k}]", f"repeats the key {entry[0]!r}")
                seen.add((type(entry[0]), entry[0]))
            entries = [
                (c, f"{path}[{key!r}]", f"{field}.dict[{k}][1]", depth + 1) for k, (key, c) in enumerate(children)
            ]
        else:
            entries = [(c, f"{path}[{k}]", f"{field}.{kind}[{k}]", depth + 1) for k, c in enumerate(children)]
        stack.extend(reversed(entries))  # children in order: the first problem in the file is reported


def _leaf(record: Any, field: str, path: str, files: dict[str, int]) -> Saved:
    if not _is_object(record) or record.get("kind") not in ("scalar", "tensor", "array"):
        kind = record.get("kind") if _is_object(record) else None
        raise _Bad(f"{field}.kind", f"is {_short(kind)}, expected 'scalar', 'tensor' or 'array'")
    if record.get("path") != path:
        raise _Bad(f"{field}.path", f"is {_short(record.get('path'))}, but the tree places this leaf at {path!r}")
    if record["kind"] == "scalar":
        return _scalar(_object(record, field, {"path", "kind", "type", "value"}), field, path)
    keys = {"path", "kind", "dtype", "shape", "boxes"} | ({"layout"} if record["kind"] == "array" else set[str]())
    record = _object(record, field, keys)
    if record["dtype"] not in DTYPES:
        raise _Bad(f"{field}.dtype", f"is {_short(record['dtype'])}, expected one of {sorted(DTYPES)}")
    shape_list = _list(record["shape"], f"{field}.shape")
    if len(shape_list) > 64:
        raise _Bad(f"{field}.shape", f"has {len(shape_list)} dimensions, more than 64")
    shape = _ints(shape_list, f"{field}.shape", len(shape_list))
    boxes = tuple(
        _box(b, f"{field}.boxes[{k}]", shape, files) for k, b in enumerate(_list(record["boxes"], f"{field}.boxes"))
    )
    layout = _layout(record["layout"], f"{field}.layout", shape) if record["kind"] == "array" else None
    dtype = DTYPES[record["dtype"]]
    return Saved(path, record["kind"], dtype, shape, layout, boxes, source=_source(boxes, shape, f"{field}.boxes"))


def _scalar(record: dict[str, Any], field: str, path: str) -> Saved:
    kind = record["type"]
    if kind not in _SCALAR_TYPES:
        raise _Bad(f"{field}.type", f"is {_short(kind)}, expected one of {sorted(_SCALAR_TYPES)}")
    value = record["value"]
    if type(value) is not _SCALAR_TYPES[kind]:
        want = "the float's repr as a string" if kind == "float" else f"a JSON {kind}"
        raise _Bad(f"{field}.value", f"is {_json_type(value)} {_short(value)}, expected {want}")
    if kind == "float":
        try:
            number = float(cast(str, value))  # a float is saved as its repr (checked above)
        except ValueError:
            number = None
        if number is None or repr(number) != value:
            raise _Bad(f"{field}.value", f"is {_short(value)}, not the repr of a float (such as '0.1' or 'nan')")
        value = number
    return Saved(path, "scalar", value=value)


def _box(value: Any, field: str, shape: tuple[int, ...], files: dict[str, int]) -> dict[str, Any]:
    box = _object(value, field, {"offsets", "sizes", "file", "tensor", "sha256"})
    offsets = _ints(box["offsets"], f"{field}.offsets", len(shape))
    sizes = _ints(box["sizes"], f"{field}.sizes", len(shape), low=1)
    for d, (o, n, s) in enumerate(zip(offsets, sizes, shape)):
        if o > s - n:
            raise _Bad(field, f"runs past the shape {shape} in dim {d} ({o} + {n} > {s})")
    if _str(box["file"], f"{field}.file") not in files:
        raise _Bad(f"{field}.file", f"is {box['file']!r}, which 'files' does not list")
    _str(box["tensor"], f"{field}.tensor")
    if not _HEX64.match(_str(box["sha256"], f"{field}.sha256")):
        raise _Bad(f"{field}.sha256", "is not 64 lowercase hex digits")
    return box


def _source(boxes: tuple[dict[str, Any], ...], shape: tuple[int, ...], field: str) -> Layout:
    """The written boxes as a layout (box k on "rank" k), so ``plan`` finds the overlaps."""
    metas = tuple(ShardMeta(tuple(b["offsets"]), tuple(b["sizes"]), Placement(k)) for k, b in enumerate(boxes))
    try:
        return Layout(shape, metas)
    except FShardError as exc:
        raise _Bad(field, f"do not tile the shape {shape} exactly ({exc})") from None


def _layout(value: Any, field: str, shape: tuple[int, ...]) -> Layout:
    data = _object(value, field, {"shape", "shards"})
    if _ints(data["shape"], f"{field}.shape", len(shape)) != shape:
        raise _Bad(f"{field}.shape", f"is {data['shape']}, but the leaf's shape is {list(shape)}")
    metas: list[ShardMeta] = []
    for k, s in enumerate(_list(data["shards"], f"{field}.shards")):
        where = f"{field}.shards[{k}]"
        s = _object(s, where, {"offsets", "sizes", "placement"})
        try:
            placement = Placement.parse(_str(s["placement"], f"{where}.placement"))
        except FShardError as exc:
            raise _Bad(f"{where}.placement", f"is {s['placement']!r}, not 'rank:R/DEVICE' ({exc})") from None
        offsets, sizes = (
            _ints(s["offsets"], f"{where}.offsets", len(shape)),
            _ints(s["sizes"], f"{where}.sizes", len(shape)),
        )
        metas.append(ShardMeta(offsets, sizes, placement))
    try:
        return Layout(shape, metas)
    except FShardError as exc:
        raise _Bad(field, f"is not a valid layout ({exc})") from None


def _check_budget(saved: list[Saved], files: dict[str, int]) -> None:
    """Each file must be large enough for the boxes said to be in it: no shape can ask for more memory."""
    need: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    for i, s in enumerate(saved):
        if s.dtype is None:
            continue
        for k, b in enumerate(s.boxes):
            if (b["file"], b["tensor"]) in seen:
                raise _Bad(f"leaves[{i}].boxes[{k}].tensor", f"{b['tensor']!r} in {b['file']} is named by two boxes")
            seen.add((b["file"], b["tensor"]))
            need[b["file"]] = need.get(b["file"], 0) + math.prod(b["sizes"]) * s.dtype.itemsize
    for name, n in need.items():
        if n > files[name]:
            raise _Bad(f"files[{name!r}].bytes", f"is {files[name]}, but the boxes in that file need {n} bytes")
