"""Counting a process group's calls in a block, for tests that assert how many collectives a program runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def calls() -> Iterator[dict[str, int]]:
    """Counts the process group calls made inside: ``{"all_to_all_single": n, "all_reduce": m}``."""
    import torch.distributed as dist

    counts = {"all_to_all_single": 0, "all_reduce": 0}
    saved = {name: getattr(dist, name) for name in counts}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return saved[name](*args, **kwargs)

        return call

    for name in counts:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
