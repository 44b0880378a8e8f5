"""Reading saved boxes: files opened on first use, byte-range reads, per-box sha256 checks."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fshard._checkpoint._format import CODES, Saved, hashing, inside, sha256
from fshard._errors import CheckpointError


class Reader:
    """Opens checkpoint files on first use; reads, checks and verifies boxes."""

    def __init__(self, data: Path, files: dict[str, Any], verify: bool, stack: contextlib.ExitStack) -> None:
        inside(data.parent, data)  # then only a file that is itself a link can lead out (see _handle)
        self.data, self.files, self.verify, self.stack = data, files, verify, stack
        self.open: dict[str, Any] = {}
        self.slices: dict[tuple[str, str], Any] = {}
        self.pool = stack.enter_context(hashing()) if verify else None
        self.pending: list[tuple[Future[str], dict[str, Any], Saved]] = []

    def _handle(self, box: dict[str, Any], saved: Saved) -> Any:
        name = box["file"]
        if name not in self.open:
            path = self.data / name
            inside(self.data.parent, path)
            # An open file stays readable if a later save deletes it (POSIX): a load sees one checkpoint.
            self.open[name] = self.stack.enter_context(self._open(path, box["tensor"], saved))
        return self.open[name]

    def _open(self, path: Path, tensor: str, saved: Saved) -> Any:
        """``safe_open(path)`` once its size matches the index; ``tensor`` and ``saved`` name what needs it."""
        missing = f"Checkpoint file {path} is missing (it holds tensor {tensor!r} of leaf {saved.where})."
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(missing) from None
        want = self.files[path.name]["bytes"]
        if size != want:
            msg = (
                f"Checkpoint file {path} has {size} bytes, index.json records {want}: it was truncated or "
                f"replaced (needed for tensor {tensor!r} of leaf {saved.where})."
            )
            raise CheckpointError(msg)
        try:
            return safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise CheckpointError(missing) from None
        except RuntimeError as exc:  # torch maps the file by its name again, so it can vanish since the stat
            if path.exists():
                raise CheckpointError(f"Checkpoint file {path} cannot be mapped: {exc}.") from None
            msg = f"Checkpoint file {path} vanished while it was opened (it holds {tensor!r} of leaf {saved.where})."
            raise CheckpointError(msg) from None
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"Checkpoint file {path} is not a readable safetensors file: {exc}.") from None

    def _slice(self, box: dict[str, Any], saved: Saved) -> Any:
        key = (box["file"], box["tensor"])
        if key not in self.slices:
            self.slices[key] = self._checked_slice(box, saved)
        return self.slices[key]

    def _checked_slice(self, box: dict[str, Any], saved: Saved) -> Any:
        path, name = self.data / box["file"], box["tensor"]
        try:
            part = self._handle(box, saved).get_slice(name)
            code, shape = part.get_dtype(), tuple(part.get_shape())
        except (SafetensorError, OSError) as exc:
            msg = f"Checkpoint file {path} has no readable tensor {name!r} (leaf {saved.where}): {exc}."
            raise CheckpointError(msg) from exc
        assert saved.dtype is not None
        if code != CODES[saved.dtype] or shape != tuple(box["sizes"]):
            msg = (
                f"Checkpoint file {path}: tensor {name!r} is {code} of shape {shape}, index.json records "
                f"{CODES[saved.dtype]} of shape {tuple(box['sizes'])}: the file does not belong to this index."
            )
            raise CheckpointError(msg)
        return part

    def open_box(self, box: dict[str, Any], saved: Saved) -> None:
        """Opens the file holding ``box`` and checks its size, and the box's dtype and shape, against the index."""
        self._slice(box, saved)

    def whole(self, box: dict[str, Any], saved: Saved) -> torch.Tensor:
        """The whole saved box; its sha256 is checked against the index in a thread (see ``check``)."""
        self._slice(box, saved)
        try:
            t = self.open[box["file"]].get_tensor(box["tensor"])
        except (SafetensorError, OSError) as exc:
            msg = f"Checkpoint file {self.data / box['file']}: reading tensor {box['tensor']!r} failed: {exc}."
            raise CheckpointError(msg) from None
        assert self.pool is not None
        self.pending.append((self.pool.submit(sha256, t), box, saved))
        return t

    def check(self) -> None:
        """Waits for the hashes of every box read so far; raises for the first that does not match."""
        for future, box, saved in self.pending:
            if future.result() != box["sha256"]:
                msg = (
                    f"Checkpoint file {self.data / box['file']}: tensor {box['tensor']!r} (leaf {saved.where}) does "
                    "not match the sha256 in index.json: the file was modified or corrupted. Restore it, or re-save."
                )
                raise CheckpointError(msg)
        self.pending.clear()

    def part(self, box: dict[str, Any], saved: Saved, index: tuple[slice, ...]) -> torch.Tensor:
        """Only the elements of ``index`` (relative to the saved box)."""
        part = self._slice(box, saved)
        try:
            return part[index] if index else self.open[box["file"]].get_tensor(box["tensor"])
        except (SafetensorError, OSError) as exc:
            msg = f"Checkpoint file {self.data / box['file']}: reading tensor {box['tensor']!r} failed: {exc}."
            raise CheckpointError(msg) from exc


def slices(lo: Sequence[int], size: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a - o, a - o + n) for a, n, o in zip(lo, size, origin))
