"""What every rank does together: agreeing on failures (all raise, none hangs) and one progress bar."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Generator
from typing import Any

from fshard._checkpoint._format import PROGRESS_MIN_BYTES
from fshard._errors import CheckpointError
from fshard.backends import Backend


def agree(backend: Backend, what: str, fn: Callable[[], Any], *, share: bool = False) -> Any:
    """Runs ``fn`` here, then tells every rank whether it failed anywhere: all ranks raise, none hangs.

    Returns ``fn``'s result, or with ``share`` every rank's result (one exchange either way).
    """
    out, shared = agree_on(backend, what, fn, (lambda o: o) if share else (lambda o: None))
    return shared if share else out


def agree_on(
    backend: Backend, what: str, fn: Callable[[], Any], summary: Callable[[Any], Any]
) -> tuple[Any, list[Any]]:
    """Like ``agree``; returns ``fn``'s result here and every rank's ``summary`` of its result (rank order)."""
    try:
        out, error = fn(), None
    except Exception as exc:
        out, error = None, exc
    problem = None if error is None else f"{type(error).__name__}: {error}"
    seen = backend.exchange((backend.rank, problem, None if error is not None else summary(out)))
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg, _ in seen if msg is not None]
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")
    return out, [s for _, _, s in seen]


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def progress_bar(desc: str, total: int, enabled: bool | None, backend: Backend) -> Generator[Any, None, None]:
    """A tqdm bar on the first rank, if tqdm is installed and ``enabled`` (``None``: a terminal and a big job)."""
    show = enabled if enabled is not None else (total >= PROGRESS_MIN_BYTES and sys.stderr.isatty())
    tqdm = None
    if show and backend.holds(0):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
    if tqdm is None:
        yield _NoBar()
        return
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False) as bar:
        yield bar
