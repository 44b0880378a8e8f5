"""The on-disk format: names, dtype codes, hashing, fsync, and reading and checking ``index.json``."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeGuard, cast

import torch

from fshard._errors import CheckpointError, SpecError
from fshard._layout.layout import Layout

__all__ = ["FORMAT", "INDEX", "MAX_DEPTH", "PROGRESS_MIN_BYTES", "VERSION"]


FORMAT = "fshard-checkpoint"


VERSION = 2


# Format versions this fshard reads: 1 is 2 without the index digest.
_READS = (1, 2)


# The top-level keys of an index (format 2 adds "digest").
_KEYS = {"format", "version", "data", "files", "tree", "leaves"}


# Trees nest at most this deep (save refuses deeper ones, load reads no deeper ones).
MAX_DEPTH = 100


INDEX = "index.json"


# Saves and loads that move at least this many bytes show a progress bar on a terminal.
PROGRESS_MIN_BYTES = 256 << 20


DATA_RE = re.compile(r"^data\.[0-9a-f]{32}$")


FILE_RE = re.compile(r"^rank-\d{5,}\.safetensors$")


TMP_RE = re.compile(r"^index\.json\.[0-9a-f]{32}\.tmp$")


# torch dtype -> safetensors dtype code, for every dtype both sides know.
CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}  # fmt: skip


DTYPES = {str(d).removeprefix("torch."): d for d in CODES}
DTYPE_OF_CODE = {code: dtype for dtype, code in CODES.items()}  # a safetensors header's dtype code -> torch dtype


def unread_dtype(code: object) -> str:
    """What a reader says of a tensor whose safetensors dtype code fshard does not read."""
    return f"has dtype {code!r}, which fshard does not read (known: {sorted(DTYPE_OF_CODE)})"


SCALARS = (bool, int, float, str, type(None))
# What a nested tensor (ragged rows) is told: checkpoints hold dense boxes.
NESTED = "checkpoints take dense tensors: pad it first (x.to_padded_tensor(0)) or save its components (x.unbind())."


def plain_scalar(leaf: bool | int | float | str | None) -> tuple[type, bool | int | float | str | None]:
    """The plain type of a scalar leaf (``SCALARS``) and its value as that type.

    A subclass (``numpy.float64``, an ``IntEnum`` member, a ``str`` enum) is saved as the value
    of its plain type, which is what ``load`` gives back: its own methods are not asked
    (``int.__int__``, not the subclass's ``__int__``), so the value is exactly the one it holds.
    """
    if leaf is None or type(leaf) in SCALARS:
        return type(leaf), leaf
    if isinstance(leaf, int):  # bool has no subclasses: an int subclass
        return int, int.__int__(leaf)
    if isinstance(leaf, float):
        return float, float.__float__(leaf)
    return str, str.__add__("", leaf)


def file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def box_text(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return ",".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes))


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a lazy conjugate or negation applied: the values it shows, in memory that holds them.

    ``z.conj()`` and ``z.conj().imag`` only set a bit on ``z``'s memory; its bytes are not their values.
    """
    return t.resolve_conj().resolve_neg()


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides.

    ``contiguous()`` keeps any stride on a dim of size 1, so a one-element view such as
    ``torch.arange(4.0)[::2][:1]`` (stride 2) needs a copy to be seen as bytes.
    """
    t = resolved(t).contiguous()
    want: list[int] = []
    step = 1
    for n in reversed(t.shape):
        want.append(step)
        step *= n
    return (
        t
        if t.stride() == tuple(reversed(want))
        else torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    )


def _bytes_of(t: torch.Tensor) -> Any:
    return _dense(t).reshape(-1).view(torch.uint8).numpy()


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes_of(t)).hexdigest()


@contextlib.contextmanager
def hashing() -> Generator[ThreadPoolExecutor, None, None]:
    """Threads for SHA-256 (hashlib releases the GIL), so hashing overlaps writes, reads and copies."""
    with ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="fshard-sha256") as pool:
        yield pool


def fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError:  # some platforms cannot fsync a directory; the rename is still atomic there
        if not directory:
            raise
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class Saved:
    """One leaf of the index, checked: a scalar's value, or a tensor's dtype, shape, layout and boxes."""

    path: str
    kind: str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    layout: Layout | None = None
    boxes: tuple[dict[str, Any], ...] = ()
    value: Any = None
    source: Layout | None = None  # the written boxes as a layout, box k on "rank" k

    @property
    def where(self) -> str:
        return self.path or "the root"


def index_digest(index: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``index`` without its ``digest``: sorted keys, no spaces, ASCII."""
    body = {k: v for k, v in index.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def checkpoint_path(path: Any, what: str) -> Path:
    """``path`` as a ``Path``, or ``TypeError`` when it is no path (a ``CheckpointError`` for a NUL byte)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} path must be a str or an os.PathLike, got {type(path).__name__}.")
    root = Path(cast("str | os.PathLike[str]", path))
    if "\x00" in str(root):
        raise CheckpointError(f"{what} path {str(root)!r} holds a NUL character, which no file name can hold.")
    return root


def check_flag(what: str, value: Any, *, optional: bool = False) -> None:
    """Raises ``TypeError`` unless ``value`` is a bool (or ``None``, where ``optional``)."""
    if type(value) is not bool and not (optional and value is None):
        allowed = "True, False or None" if optional else "True or False"
        raise TypeError(f"{what} must be {allowed}, got {value!r} ({type(value).__name__}).")


def inside(root: Path, path: Path) -> None:
    """Refuses ``path`` (the index or a data file) if it resolves outside the checkpoint directory ``root``.

    A symlink there would make ``load`` read, and return, any file this process can read. ``path`` is
    ``root`` (or a directory already checked) joined with one checked name (never ``..``), so only a
    link at ``path`` itself can lead out, and anything else costs one ``lstat``.
    """
    if not path.is_symlink():
        return
    try:
        real, top = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop, before Python 3.13
        raise CheckpointError(f"Checkpoint path {path} cannot be resolved: {exc}.") from None
    if not real.is_relative_to(top):
        msg = (
            f"{path} resolves to {real}, outside the checkpoint directory {top}: load reads only files inside "
            "the checkpoint. Replace the link with the file it points to, or copy the checkpoint."
        )
        raise CheckpointError(msg)


def _is_dict(value: object) -> TypeGuard[dict[str, Any]]:
    """``isinstance(value, dict)``; a parsed JSON object's keys are strings."""
    return isinstance(value, dict)


def _not_a_checkpoint(root: Path, is_dir: bool) -> str:
    """Why ``root``, which holds no ``index.json``, is read by none of the loaders, and what to do."""
    if not is_dir:
        return (
            f"{root} does not exist: give an fshard checkpoint's folder, a torch DCP folder, or a Hugging Face "
            "safetensors file or folder."
        )
    try:
        names = [p.name for p in root.iterdir()]
    except OSError:
        names = []
    if any(n.endswith(".bin") or n == "pytorch_model.bin.index.json" for n in names):
        return (
            f"{root} holds PyTorch .bin weights (torch.save pickles), which fshard does not read: save the model "
            "as safetensors first (transformers' model.save_pretrained(folder), safetensors by default), then "
            "read that folder."
        )
    if any(n.endswith(".distcp") or (n.startswith("__") and n.endswith(".metadata")) for n in names):
        return (
            f"{root} holds torch DCP data files but no .metadata file: a folder saved with "
            "use_collectives=False (a metadata file per rank) or a save that did not finish. fshard reads DCP "
            "folders with one .metadata (dcp.save with its collectives); save it that way."
        )
    return (
        f"{root / INDEX} does not exist (an interrupted fshard save leaves no index), and {root} holds no .metadata "
        "(torch DCP) or .safetensors files (Hugging Face): it is no checkpoint that fshard reads."
    )


def read_index(root: Path) -> tuple[dict[str, Any], str]:
    """``index.json`` with its top level and digest checked, and the SHA-256 of its bytes as read.

    The leaves are checked by ``_schema.saved_leaves``.
    """
    where = root / INDEX
    try:
        found, is_dir, exists = where.is_file(), root.is_dir(), where.exists()
    except OSError as exc:
        raise CheckpointError(f"Checkpoint path {root} cannot be read: {exc.strerror or exc}.") from exc
    if exists and not found:
        raise CheckpointError(f"{where} is not a file: {root} is not an fshard checkpoint, or its index was replaced.")
    if not found:
        raise CheckpointError(_not_a_checkpoint(root, is_dir))
    inside(root, where)
    try:
        raw = where.read_bytes()
        index = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON, huge ints
        raise CheckpointError(f"{where} is not valid JSON ({exc}); the checkpoint index is damaged.") from None
    if not _is_dict(index) or index.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not an fshard checkpoint index (no 'format': {FORMAT!r}).")
    version = index.get("version")
    if type(version) is not int or version not in _READS:
        msg = f"{where} has format version {version!r}; this fshard reads {list(_READS)}: upgrade fshard."
        raise CheckpointError(msg)
    keys = _KEYS | ({"digest"} if version >= 2 else set[str]())
    if set(index) != keys:
        msg = (
            f"{where} is malformed: its top-level keys are {sorted(index)}, format {version} has {sorted(keys)}. "
            "The checkpoint index is damaged: restore it or re-save."
        )
        raise CheckpointError(msg)
    if version >= 2:
        _check_digest(where, index)
    if type(index["data"]) is not str or not DATA_RE.match(index["data"]):
        raise CheckpointError(f"{where} names data directory {index['data']!r}, not 'data.<32 hex digits>'.")
    return index, hashlib.sha256(raw).hexdigest()


def _check_digest(where: Path, index: dict[str, Any]) -> None:
    try:
        digest = index_digest(index)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} cannot be put in canonical form ({exc}); the index is damaged.") from None
    if index["digest"] != digest:
        msg = (
            f"{where} does not match its digest (recorded {str(index['digest'])[:16]}..., content "
            f"{digest[:16]}...): the index was edited or damaged after the save. Restore it, or re-save."
        )
        raise CheckpointError(msg)


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def check_not_partial(what: str, layout: Layout) -> None:
    """Raises ``SpecError`` if ``layout`` (the target of ``what``, a leaf or tensor) is a pending reduction.

    A checkpoint holds values, not summands.
    """
    if layout.partial is not None:
        msg = (
            f"{what}: the target layout has a pending {layout.partial} (partial={layout.partial!r}), but "
            "a checkpoint holds values, not summands: load into the spec without Partial(...)."
        )
        raise SpecError(msg)
