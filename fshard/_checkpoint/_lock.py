"""One save at a time per checkpoint directory: an exclusive, non-blocking ``flock`` on ``path/save.lock``.

Two saves to one path would each delete the other's data after their commit, so
the second index could name files the first deleted. The rank that commits takes
this lock before it writes and keeps it until the old data is gone; a second
saver is refused at once (never waits). The lock file is removed while still
held, so a saver that opened it just before must find it gone (or another file
there) and tries again: no two savers ever hold locks on two files of one name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from pathlib import Path

from fshard._errors import CheckpointError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; one saver per path is then the caller's duty
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK", "save_lock"]


LOCK = "save.lock"


@contextlib.contextmanager
def save_lock(root: Path) -> Generator[None, None, None]:
    """Holds the save lock of the checkpoint directory ``root`` (created if missing).

    Raises:
        CheckpointError: another save holds it, or the lock file cannot be made.
    """
    fd = _acquire(root)
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(root / LOCK)  # while held: see the module's docstring
            os.close(fd)


def _acquire(root: Path) -> int | None:
    if fcntl is None:  # pragma: no cover
        return None
    where = root / LOCK
    for _ in range(3):  # a holder releasing between our open and our flock makes us try the new file
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(where, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise CheckpointError(f"Checkpoint path {root}: cannot create the lock file {where}: {exc}.") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(root, where) from None
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(f"Checkpoint path {root}: cannot lock {where}: {exc}.") from exc
        if _names(where, fd):
            return fd
        os.close(fd)
    raise _busy(root, where)


def _names(where: Path, fd: int) -> bool:
    """Whether ``where`` is still the file open as ``fd``."""
    try:
        here, held = os.stat(where, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _busy(root: Path, where: Path) -> CheckpointError:
    msg = (
        f"Checkpoint path {root} is being written by another save: another save holds it ({where} is locked). "
        "One save at a time per path: wait for that save to finish, or save to another path. "
        "Nothing was committed; the checkpoint there is unchanged."
    )
    return CheckpointError(msg)
