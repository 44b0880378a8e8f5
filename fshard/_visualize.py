"""Text pictures of 1-D and 2-D layouts, like ``jax.debug.visualize_array_sharding``."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fshard._layout import Layout

__all__ = ["visualize"]

_MAX_CUTS = 24


def visualize(layout: Layout, width: int = 60) -> str:
    """Draws the non-empty boxes of ``layout`` with the ranks that hold each one."""
    if layout.ndim not in (1, 2):
        return f"<{layout.ndim}-D layout of shape {layout.shape}: only 1-D and 2-D are drawn>"
    shape = layout.shape if layout.ndim == 2 else (1, *layout.shape)
    lo = layout._lo if layout.ndim == 2 else np.c_[np.zeros(len(layout.shards), np.int64), layout._lo]
    sz = layout._sz if layout.ndim == 2 else np.c_[np.ones(len(layout.shards), np.int64), layout._sz]
    keep = np.flatnonzero((sz > 0).all(axis=1))
    labels: dict[tuple[int, int, int, int], list[str]] = {}
    for i in keep.tolist():
        key = (int(lo[i, 0]), int(lo[i, 0] + sz[i, 0]), int(lo[i, 1]), int(lo[i, 1] + sz[i, 1]))
        labels.setdefault(key, []).append(_label(layout, i))
    rows = sorted({b for k in labels for b in k[:2]} | {0, shape[0]})
    cols = sorted({b for k in labels for b in k[2:]} | {0, shape[1]})
    if len(rows) > _MAX_CUTS or len(cols) > _MAX_CUTS:
        return f"<layout of shape {layout.shape} with {len(layout.shards)} shards: too fine to draw>"
    text = {k: " ".join(v) for k, v in labels.items()}
    xs = _positions(cols, shape[1], width, max((len(t) for t in text.values()), default=1))
    ys = _positions(rows, shape[0], 2 * (len(rows) - 1), 0) if layout.ndim == 2 else [0, 2]
    canvas = [[" "] * (xs[-1] + 1) for _ in range(ys[-1] + 1)]
    for (r0, r1, c0, c1), t in text.items():
        _box(canvas, ys[rows.index(r0)], ys[rows.index(r1)], xs[cols.index(c0)], xs[cols.index(c1)], t)
    body = "\n".join("".join(line).rstrip() for line in canvas)
    empty = [_label(layout, i) for i in range(len(layout.shards)) if i not in set(keep.tolist())]
    return body + (f"\n(empty shards: {' '.join(empty)})" if empty else "")


def _label(layout: Layout, i: int) -> str:
    p = layout.shards[i].placement
    return f"r{p.rank}" if p.device == "cpu" else f"r{p.rank}:{p.device}"


def _positions(cuts: list[int], extent: int, width: int, label: int) -> list[int]:
    """Canvas coordinates of each cut: proportional to size, wide enough for the labels."""
    out, x = [0], 0
    for a, b in itertools.pairwise(cuts):
        span = max(label + 2, round((b - a) / max(extent, 1) * width), 2)
        x += span
        out.append(x)
    return out


def _box(canvas: list[list[str]], y0: int, y1: int, x0: int, x1: int, text: str) -> None:
    for x in range(x0, x1 + 1):
        for y in (y0, y1):
            canvas[y][x] = "+" if x in (x0, x1) or canvas[y][x] in "|+" else "-"
    for y in range(y0 + 1, y1):
        for x in (x0, x1):
            canvas[y][x] = "+" if canvas[y][x] in "-+" else "|"
    y = (y0 + y1) // 2
    start = x0 + 1 + max(0, (x1 - x0 - 1 - len(text)) // 2)
    for k, ch in enumerate(text[: max(0, x1 - x0 - 1)]):
        canvas[y][start + k] = ch
