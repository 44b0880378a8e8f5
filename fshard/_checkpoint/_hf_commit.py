"""Making a written Hugging Face folder appear: files under temporary names, renamed once all are complete.

Every file is written into a staging folder beside the target, ``.<name>.<token>.tmp``.
When every rank has written and fsynced its files, one rank commits: a folder that did
not exist is the staging folder renamed (it appears whole, at once, and a second save
that began before it appeared fails its own rename and raises); into an existing
folder each weight file is renamed into place, the index last, and then the weight
files of an earlier save that the new index does not name are removed. Until the
commit nothing at the target has changed, and a failed save removes its staging folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Generator, Sequence
from pathlib import Path

from safetensors import SafetensorError

from fshard._checkpoint._dcp_meta import METADATA
from fshard._checkpoint._detect import HF_INDEX
from fshard._checkpoint._format import INDEX, fsync
from fshard._errors import CheckpointError

__all__ = ["check_target", "commit", "discard", "stage_for", "writing"]


# The weight files a save writes; in an existing folder those of an earlier save are replaced.
_WEIGHTS_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")


def stage_for(root: Path, token: str) -> Path:
    """The staging folder of a save to ``root`` (on the same file system, so renames are atomic)."""
    return root.parent / f".{root.name}.{token}.tmp"


def check_target(root: Path) -> bool:
    """Whether ``root`` exists; refuses a file, or a checkpoint that ``load`` would read before the files saved.

    An fshard checkpoint's ``index.json`` and a torch DCP folder's ``.metadata`` win over
    safetensors files in the same folder (``checkpoint_kind``).
    """
    with writing(root):
        if root.is_dir():
            for marker, kind in ((INDEX, "an fshard checkpoint"), (METADATA, "a torch DCP checkpoint")):
                if (root / marker).exists():
                    msg = (
                        f"save_safetensors() path {root} is {kind} (it holds {marker}), which load() would read "
                        "instead of the files saved: save the Hugging Face folder elsewhere, or remove that "
                        "checkpoint first."
                    )
                    raise CheckpointError(msg)
            return True
        if root.exists() or root.is_symlink():
            raise CheckpointError(f"save_safetensors() path {root} exists and is not a folder: give a folder path.")
        root.parent.mkdir(parents=True, exist_ok=True)
        return False


@contextlib.contextmanager
def writing(path: Path) -> Generator[None, None, None]:
    """Turns a failure at ``path`` into a ``CheckpointError`` naming it and the cause."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        cause = f"{exc.strerror} (errno {exc.errno})" if isinstance(exc, OSError) and exc.strerror else str(exc)
        msg = (
            f"Saving a Hugging Face folder failed at {path}: {cause}. Nothing was committed: the folder there "
            "(if any) is unchanged. Free space or fix the file system, then save again."
        )
        raise CheckpointError(msg) from exc


def commit(root: Path, stage: Path, names: Sequence[str], index: str | None, *, fresh: bool) -> None:
    """Writes the index (if any) into ``stage``, then puts the staged files at ``root`` (see the module).

    ``fresh``: ``root`` did not exist when the save began, so no save lock is held: the commit is
    the staging folder's rename alone, which fails where another save made ``root`` meanwhile.
    """
    missing = [n for n in names if not (stage / n).is_file()]
    if missing:
        msg = (
            f"Saving {root}: {missing[:3]} are not in {stage} although their writers finished: every rank must "
            "write to one shared file system. Nothing was committed."
        )
        raise CheckpointError(msg)
    if index is not None:
        with writing(stage / HF_INDEX), open(stage / HF_INDEX, "w", encoding="utf-8") as f:
            f.write(index)
            f.flush()
            os.fsync(f.fileno())
    with writing(stage):
        fsync(stage, directory=True)
    new = [*names, *([HF_INDEX] if index is not None else [])]
    if fresh:
        try:
            os.rename(stage, root)  # onto nothing, or an empty folder; never into another save's files
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                with writing(root):
                    raise
            msg = (
                f"save_safetensors() path {root} was made by another save while this one wrote (it did not exist "
                "when this save began): one save at a time per path. Nothing of this save was committed; the "
                "folder there is the other save's."
            )
            raise CheckpointError(msg) from exc
        with writing(root):
            fsync(root.parent, directory=True)
        return
    with writing(root):
        for name in new:
            os.replace(stage / name, root / name)
        for p in root.iterdir():
            if _WEIGHTS_RE.match(p.name) and p.name not in new and p.is_file():
                p.unlink()
        stage.rmdir()
        fsync(root, directory=True)


def discard(stage: Path) -> None:
    """Removes a staging folder that will not be committed."""
    shutil.rmtree(stage, ignore_errors=True)
