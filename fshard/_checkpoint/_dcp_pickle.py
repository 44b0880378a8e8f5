"""Reading a torch DCP ``.metadata`` pickle with an allow-list: nothing a checkpoint names ever runs.

``pickle`` builds objects by calling what the stream names (``find_class``), so a crafted
``.metadata`` could run any function. ``_Unpickler.find_class`` answers only for the names
that ``torch.distributed.checkpoint`` (2.0 to 2.13) writes, and for each returns a stand-in
of fshard's own: a plain record for each DCP dataclass (its state kept as given, no torch
code runs, so torch.distributed is not even imported), ``tuple`` for ``torch.Size``, and
lookups in fixed tables for dtypes and layouts. Any other name raises ``CheckpointError``.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from fshard._errors import CheckpointError

__all__ = ["ALLOWED", "Record", "unpickle"]


class Record:
    """A DCP dataclass as data: ``kind`` (its class name) and the state pickle gave it."""

    kind = "Record"

    def __init__(self, *args: Any) -> None:
        self.state: Any = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def get(self, name: str, default: Any = None) -> Any:
        """The field ``name`` of a record whose state is a dict of fields (``default`` when absent)."""
        state: Any = self.state
        return cast("dict[str, Any]", state).get(name, default) if isinstance(state, dict) else default

    def __repr__(self) -> str:
        return f"{self.kind}({self.state!r})"


_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


def _record_class(name: str) -> type[Record]:
    return type(name, (Record,), {"kind": name, "__slots__": ()})


# The classes DCP pickles into .metadata: the Metadata dataclasses, and the file system
# writer's per-item storage info (its planner data is a dict of tuples of str and int).
_RECORDS: dict[tuple[str, str], type[Record]] = {
    (_METADATA, name): _record_class(name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
    )
}
_RECORDS[(_FILESYSTEM, "_StorageInfo")] = _record_class("_StorageInfo")


def _size(values: Any = ()) -> tuple[Any, ...]:
    """``torch.Size(values)`` as a tuple (checked as ints where it is used)."""
    return tuple(values)


def _enum_value(value: Any) -> Any:
    """``_MEM_FORMAT_ENCODING(value)``: the member's value, which nothing here needs."""
    return value


def _path(*parts: Any) -> str:
    """``pathlib.PosixPath(*parts)`` (the checkpoint id DCP records) as text; no file is touched."""
    return "/".join(str(p) for p in parts)


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: Any) -> torch.layout:
    """``torch.serialization._get_layout(name)``, from a fixed table of torch's layouts."""
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


# torch's dtypes, layouts and memory formats are pickled by reference (``torch.float32``).
_TORCH_VALUES = {
    ("torch", name): value
    for name, value in vars(torch).items()
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
}

_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): _size,
    (_METADATA, "_MEM_FORMAT_ENCODING"): _enum_value,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}

# Every (module, name) a .metadata pickle may name.
ALLOWED: frozenset[tuple[str, str]] = frozenset(_RECORDS) | frozenset(_TORCH_VALUES) | frozenset(_FUNCTIONS)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: Path) -> None:
        super().__init__(io.BytesIO(data), fix_imports=False)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        found = _RECORDS.get(key) or _TORCH_VALUES.get(key) or _FUNCTIONS.get(key)
        if found is None:
            msg = (
                f"{self.where} names {module}.{name}, which torch.distributed.checkpoint does not write into "
                "its metadata: fshard refuses to unpickle it (nothing in a checkpoint runs). The file is not "
                "DCP metadata or was tampered with; if you trust it, load it with torch.distributed.checkpoint."
            )
            raise CheckpointError(msg)
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.where} holds a persistent id ({str(pid)[:60]}): DCP metadata has none.")


def unpickle(data: bytes, where: Path) -> Any:
    """The object ``data`` pickles, built from allow-listed names only (``where`` names the file).

    Raises:
        CheckpointError: the stream names anything else, or is no valid pickle.

    >>> import pickle, os
    >>> unpickle(pickle.dumps({"a": (1, 2)}), Path(".metadata"))
    {'a': (1, 2)}
    >>> class Payload:
    ...     def __reduce__(self):
    ...         return (os.system, ("echo never",))
    >>> unpickle(pickle.dumps(Payload()), Path(".metadata"))
    Traceback (most recent call last):
    fshard.CheckpointError: .metadata names ...system, which torch.distributed.checkpoint does not ...
    """
    try:
        return _Unpickler(data, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged stream: any of pickle's many error types
        raise CheckpointError(f"{where} is not a readable DCP metadata pickle: {type(exc).__name__}: {exc}.") from None
