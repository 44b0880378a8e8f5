"""Text pictures of layouts, drawn to scale like ``jax.debug.visualize_array_sharding``.

A 2-D layout is drawn to scale, a 1-D layout as one band of one line, an N-D layout
over the (at most two) dims that its boxes split, and anything else as a few lines of
summary. The cuts of the boxes split each drawn dim into bands; to scale means:

- each band's inside (the lines or characters between its borders) is proportional to
  its extent, within rounding, and bands of equal extent are drawn equal;
- every band gets at least one line and, across, its label and a space, so each box
  shows its label;
- the picture is at most ``width + 1`` characters wide; its height follows the array's
  aspect (a character cell counts as ``_CELL`` times as tall as it is wide) within
  ``width / 4`` lines, and grows past that, up to ``width`` lines, where the thinnest
  band needs it to get its one line with the others in proportion. Bands too thin to
  keep in proportion even then keep their least size (one line; across, their label's
  room), and the others share the rest in proportion. The text is plain; ``color`` adds one
terminal colour per rank through ``rich`` when it is installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal, Protocol, Union

import numpy as np

from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.validate import Columns, ShardLike

__all__ = [
    "MAX_SHARDS",
    "MAX_WIDTH",
    "Picture",
    "describe_layout",
    "draw",
    "layout_repr",
    "span",
    "summands_line",
    "visualize",
]


class Layout(Protocol):
    """What the pictures and descriptions read of a layout (``fshard.Layout`` is one)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def partial(self) -> str | None: ...
    @property
    def terms(self) -> np.ndarray | None: ...
    @property
    def ndim(self) -> int: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def shards(self) -> Sequence[ShardLike]: ...
    @property
    def columns(self) -> Columns: ...


# Arguments are checked at run time whatever their annotations say: callers may be untyped.
# pyright: reportUnnecessaryIsInstance=false

MAX_SHARDS = 64  # a layout with more shards prints a summary

ColorMode = Union[bool, Literal["auto"]]

# The widest picture drawn, in characters: the canvas is width x height cells.
MAX_WIDTH = 1000
_MAX_CUTS = 24
_CELL = 2.5  # a terminal character is about this many times as tall as it is wide
_PALETTE = (
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
    "#9edae5", "#ffd92f", "#b3de69", "#fccde5", "#80b1d3", "#fdb462", "#bebada", "#8dd3c7",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Picture:
    """Lines of text and, per box interior, ``(line, start, stop, rank)`` runs to colour."""

    lines: tuple[str, ...]
    fills: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def visualize(layout: Layout, width: int = 60, color: ColorMode = False) -> str:
    """The picture of ``layout``, at most about ``width`` characters wide; see ``Layout.visualize``.

    Raises:
        SpecError: a ``width`` that is not an int from 4 to ``MAX_WIDTH``, or a ``color`` that is
            not ``True``, ``False`` or ``"auto"`` (a ``ValueError``).
    """
    return paint(draw(layout, width), color)


def draw(layout: Layout, width: int = 60) -> Picture:
    """The picture of ``layout``: a to-scale drawing where one fits, else a summary."""
    if not isinstance(width, int) or isinstance(width, bool) or not 4 <= width <= MAX_WIDTH:
        msg = f"visualize() width must be an int of at least 4 characters, got {width!r}."
        if isinstance(width, int) and width > MAX_WIDTH:
            msg = f"visualize() width must be at most {MAX_WIDTH} characters, got {width!r}."
        raise SpecError(msg)
    if 0 in layout.shape:
        ranks = " ".join(_label(layout, i) for i in range(len(layout.shards)))
        return Picture((f"<empty layout of shape {layout.shape}: no elements; shards on {ranks or 'no rank'}>",))
    dims = _drawn_dims(layout)
    if dims is None:
        return Picture(_summary(layout, "its boxes split more than two dims"))
    boxes = _boxes_over(layout, dims)
    shape = tuple(layout.shape[d] for d in dims)
    pic = _grid(layout, boxes, shape if len(shape) == 2 else (1, shape[0] if shape else 1), width, len(shape) == 2)
    if pic is None:
        return Picture(_summary(layout, "too fine to draw"))
    head = () if layout.ndim <= 2 else (_header(layout, dims),)
    empty = [_label(layout, i) for i in range(len(layout.shards)) if not all(layout.shards[i].sizes)]
    tail = (f"(empty shards: {' '.join(empty)})",) if empty else ()
    shifted = tuple((y + len(head), x0, x1, r) for y, x0, x1, r in pic.fills)
    return Picture(head + pic.lines + tail, shifted)


def _drawn_dims(layout: Layout) -> tuple[int, ...] | None:
    """The dims to draw: all of a 1-D or 2-D layout, else those its boxes split (``None``: over two)."""
    if layout.ndim <= 2:
        return tuple(range(layout.ndim))
    full = np.array(layout.shape, np.int64)
    live = (layout.columns.sz > 0).all(axis=1)
    split = [
        d
        for d in range(layout.ndim)
        if ((layout.columns.sz[live, d] != full[d]) | (layout.columns.lo[live, d] != 0)).any()
    ]
    if len(split) > 2:
        return None
    return tuple(split) or (0,)


def _boxes_over(layout: Layout, dims: tuple[int, ...]) -> dict[tuple[int, int, int, int], list[int]]:
    """Each distinct non-empty box as ``(row0, row1, col0, col1)`` over ``dims`` -> its shard indices."""
    out: dict[tuple[int, int, int, int], list[int]] = {}
    for i, meta in enumerate(layout.shards):
        if not all(meta.sizes):
            continue
        lo = [meta.offsets[d] for d in dims]
        hi = [meta.offsets[d] + meta.sizes[d] for d in dims]
        key = (lo[0], hi[0], lo[1], hi[1]) if len(dims) == 2 else (0, 1, *(lo + hi or [0, 1]))
        out.setdefault(key, []).append(i)  # type: ignore[arg-type]
    return out


def _grid(
    layout: Layout, boxes: dict[tuple[int, int, int, int], list[int]], shape: tuple[int, int], width: int, tall: bool
) -> Picture | None:
    """Boxes on a canvas whose bands are as tall and as wide as their extents (see ``_sizes``)."""
    rows = sorted({b for k in boxes for b in k[:2]} | {0, shape[0]})
    cols = sorted({b for k in boxes for b in k[2:]} | {0, shape[1]})
    if len(rows) > _MAX_CUTS or len(cols) > _MAX_CUTS:
        return None
    text = {k: _ranks_label(layout, v) for k, v in boxes.items()}
    label = max(map(len, text.values()), default=1)
    heights, widths = _sizes(shape, _gaps(rows), _gaps(cols), width, label + 1, tall)
    ys = list(itertools.accumulate((h + 1 for h in heights), initial=0))
    xs = list(itertools.accumulate((w + 1 for w in widths), initial=0))
    canvas = [[" "] * (xs[-1] + 1) for _ in range(ys[-1] + 1)]
    fills: list[tuple[int, int, int, int]] = []
    for (r0, r1, c0, c1), t in text.items():
        y0, y1, x0, x1 = ys[rows.index(r0)], ys[rows.index(r1)], xs[cols.index(c0)], xs[cols.index(c1)]
        _box(canvas, y0, y1, x0, x1, t)
        owner = min(layout.shards[i].placement.rank for i in boxes[(r0, r1, c0, c1)])
        fills += [(y, x0 + 1, x1, owner) for y in range(y0 + 1, y1)]
    return Picture(tuple("".join(line).rstrip() for line in canvas), tuple(fills))


def _gaps(cuts: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(cuts)]


def _sizes(
    shape: tuple[int, int], rows: list[int], cols: list[int], width: int, least: int, tall: bool
) -> tuple[list[int], list[int]]:
    """Lines inside each band of ``rows`` and characters inside each band of ``cols`` (their extents).

    By the rule in the module's docstring: a canvas of ``shape``'s aspect within ``width``
    across and ``width / 4`` down, grown in both directions where the thinnest band needs
    room (one line; ``least`` characters, a label and a space), at most ``width`` across
    and, down, ``width`` or the thinnest row band's need if that is less.
    """
    if not tall:
        return [1], _fit(cols, width - len(cols), least)
    aspect = shape[0] / shape[1] / _CELL  # canvas lines per canvas character
    across, down = float(width), max(2.0, width / 4)
    if across * aspect > down:
        across = down / aspect
    else:
        down = across * aspect
    need_down = len(rows) + shape[0] / min(rows)  # the thinnest band one line, the rest in proportion
    need_across = len(cols) + least * shape[1] / min(cols)
    grow = max(1.0, need_down / down, need_across / across)
    across = min(float(width), across * grow)
    down = min(max(width / 4, min(float(width), need_down)), down * grow)
    return _lines(rows, round(down) - len(rows)), _fit(cols, round(across) - len(cols), least)


def _lines(extents: list[int], room: int) -> list[int]:
    """Lines inside each band of rows, adding up to at most ``room``.

    The thinnest band gets ``k`` lines (as many as fit), each other its extent times ``k``
    over the thinnest's, rounded; ``_fit`` shares the room where even ``k = 1`` does not fit.
    """
    thin = min(extents)
    for k in range(max(1, room * thin // sum(extents) + 1), 0, -1):
        out = [math.floor(e * k / thin + 0.5) for e in extents]
        if sum(out) <= room:
            return out
    return _fit(extents, room, 1)


def _fit(extents: list[int], room: int, least: int) -> list[int]:
    """Sizes proportional to ``extents`` within rounding, each at least ``least``, adding up to at most ``room``.

    The largest scale whose rounded sizes fit (by bisection), so equal extents get equal
    sizes; then the bands of an extent whose next size that scale just missed get it, the
    widest first, while the room lasts.
    """

    def sizes(scale: float) -> list[int]:
        return [max(least, math.floor(e * scale + 0.5)) for e in extents]

    lo, hi = 0.0, max(room, least) / min(extents) + 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(sizes(mid)) <= room else (lo, mid)
    out, near = sizes(lo), sizes(hi)
    for e in sorted({e for e, a, b in zip(extents, out, near) if b > a}, reverse=True):
        if sum(out) + extents.count(e) <= room:
            out = [n + 1 if x == e else n for x, n in zip(extents, out)]
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


def _label(layout: Layout, i: int) -> str:
    p = layout.shards[i].placement
    return f"r{p.rank}" if p.device == "cpu" else f"r{p.rank}:{p.device}"


def _ranks_label(layout: Layout, index: list[int]) -> str:
    """The holders of one box: ``r0 r1``, with runs of three or more cpu ranks as ``r0-3``."""
    ranks = sorted(layout.shards[i].placement.rank for i in index if layout.shards[i].placement.device == "cpu")
    words = [_label(layout, i) for i in index if layout.shards[i].placement.device != "cpu"]
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    cpu = [f"r{run[0]}-{run[-1]}" if len(run) > 2 else " ".join(f"r{r}" for r in run) for run in runs]
    return " ".join(cpu + words)


def _header(layout: Layout, dims: tuple[int, ...]) -> str:
    whole = [d for d in range(layout.ndim) if d not in dims]
    over = f"dims {dims[0]} and {dims[1]}" if len(dims) == 2 else f"dim {dims[0]}"
    rest = f"dim {whole[0]}" if len(whole) == 1 else "dims " + ", ".join(map(str, whole))
    return f"{layout.ndim}-D layout of shape {layout.shape}, drawn over {over}; every box spans {rest} whole:"


def _summary(layout: Layout, why: str) -> tuple[str, ...]:
    """A few lines in place of a picture: how each dim is split and what each rank holds."""
    live = np.flatnonzero((layout.columns.sz > 0).all(axis=1))
    lines = [f"<{layout.ndim}-D layout of shape {layout.shape}, {len(layout.shards)} shards: {why}>"]
    for d in range(layout.ndim):
        cuts = np.unique(
            np.r_[
                layout.columns.lo[live, d], layout.columns.lo[live, d] + layout.columns.sz[live, d], 0, layout.shape[d]
            ]
        )
        sizes = np.diff(cuts).tolist()
        shown = ", ".join(map(str, sizes[:8])) + (f", ... ({len(sizes)} blocks)" if len(sizes) > 8 else "")
        lines.append(f"  dim {d}: whole" if len(sizes) == 1 else f"  dim {d}: blocks of {shown}")
    held: dict[int, list[int]] = {}
    for i in live.tolist():
        held.setdefault(layout.shards[i].placement.rank, []).append(layout.shards[i].numel)
    per_rank = {(len(v), sum(v)) for v in held.values()}
    if len(per_rank) == 1:
        n, elements = per_rank.pop()
        lines.append(f"  each of ranks {_span(sorted(held))} holds {_count(n, 'shard')}, {_count(elements, 'element')}")
        return tuple(lines)
    for r in sorted(held)[:8]:
        lines.append(f"  rank {r} holds {_count(len(held[r]), 'shard')}, {_count(sum(held[r]), 'element')}")
    if len(held) > 8:
        lines.append(f"  ... and {len(held) - 8} more ranks")
    return tuple(lines)


def _span(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def paint(picture: Picture, color: ColorMode) -> str:
    """``picture`` as text, with each box's interior in its lowest rank's colour where ``color`` asks.

    ``True`` colours with ANSI codes; ``"auto"`` only when standard output is a terminal
    that takes colour (``NO_COLOR`` unset). Both need ``rich``; without it the text is plain.
    """
    if not (isinstance(color, bool) or (isinstance(color, str) and color == "auto")):
        raise SpecError(f"visualize() color must be True, False or 'auto', got {color!r}.")
    if color is False or not picture.fills:
        return picture.text
    try:
        from rich.console import Console
        from rich.text import Text
    except ImportError:
        return picture.text
    system: Any = _color_system(Console()) if color == "auto" else "256"
    if system is None:
        return picture.text
    text = Text("\n".join(picture.lines))
    starts = list(itertools.accumulate((len(line) + 1 for line in picture.lines), initial=0))
    for y, x0, x1, rank in picture.fills:
        text.stylize(f"black on {_PALETTE[rank % len(_PALETTE)]}", starts[y] + x0, starts[y] + x1)
    out = Console(force_terminal=True, color_system=system, width=max(map(len, picture.lines)) + 1)
    with out.capture() as captured:
        out.print(text, end="", soft_wrap=True, highlight=False)
    return captured.get()


def _color_system(console: object) -> str | None:
    """The colour system of a console on standard output, ``None`` where it shows no colour."""
    if not getattr(console, "is_terminal", False) or getattr(console, "no_color", False):
        return None
    return getattr(console, "color_system", None)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# -- text: repr and one-line descriptions -------------------------------------------------


def layout_repr(layout: Any) -> str:
    """``Layout(shape=(4,), shards=[((0,), (2,), 0), ((2,), (2,), 1)])``; a summary past ``MAX_SHARDS``."""
    pending = f", partial={layout.partial!r}" if layout.partial else ""
    if len(layout.shards) > MAX_SHARDS:
        ranks = span(layout.ranks)
        return f"Layout(shape={layout.shape}, {len(layout.shards)} shards on ranks {ranks}{pending})"
    if layout.terms is not None:
        pending += f", terms={layout.terms.tolist()}"
    shards = ", ".join(f"({m.offsets}, {m.sizes}, {_placement(m.placement)})" for m in layout.shards)
    return f"Layout(shape={layout.shape}, shards=[{shards}]{pending})"


def _placement(p: Any) -> str:
    return str(p.rank) if p.device == "cpu" else repr(str(p))


def span(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def summands_line(layout: Layout, most: int = 4) -> str:
    """The line under a partial layout's picture: the pending op and which copies are its summands.

    Where copies of one summand are replicas (``terms``), each box's summands are listed as
    the ranks that hold them, for the first ``most`` boxes.
    """
    op = layout.partial
    if layout.terms is None:
        return f"(pending {op}: each element is the {op} of its copies)"
    lo, sz, rank = layout.columns.lo, layout.columns.sz, layout.columns.rank
    nonempty = np.flatnonzero((sz > 0).all(axis=1))
    _, first, box_of = np.unique(np.c_[lo, sz][nonempty], axis=0, return_index=True, return_inverse=True)
    shown = np.argsort(first)[:most]  # the first boxes, in layout order: only their shards are read
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], dict[int, list[int]]] = {}
    for i in nonempty[np.isin(box_of.reshape(-1), shown)].tolist():
        box = (tuple(lo[i].tolist()), tuple(sz[i].tolist()))
        boxes.setdefault(box, {}).setdefault(int(layout.terms[i]), []).append(int(rank[i]))
    parts = [
        ("[" + ", ".join(f"{o}:{o + n}" for o, n in zip(*box)) + "]: " if len(boxes) > 1 or layout.ndim else "")
        + " + ".join("{" + ",".join(f"r{r}" for r in sorted(set(ranks))) + "}" for ranks in terms.values())
        for box, terms in boxes.items()
    ]
    more = "; ..." if len(first) > len(boxes) else ""
    return f"(pending {op} of summands; the ranks in braces hold replicas of one summand: {'; '.join(parts)}{more})"


@cached(1024)
def _layout_digest(layout: Layout) -> str:
    h = hashlib.blake2b(digest_size=6)
    h.update(repr((layout.shape, layout.partial)).encode())
    if layout.terms is not None:
        h.update(layout.terms.tobytes())
    for a in (layout.columns.lo, layout.columns.sz, layout.columns.rank):
        h.update(np.ascontiguousarray(a, np.int64).tobytes())
    # Device types, not indices: ranks may name one layout's devices differently (each its own GPU).
    h.update("|".join(d.split(":")[0] for d in layout.columns.devices).encode())
    return h.hexdigest()


def describe_layout(layout: Layout, most: int = 6) -> str:
    """``shape (8, 12): [0:4, 0:12]@0 [4:8, 0:12]@1 #1a2b...``: boxes, ranks and a digest of the whole."""
    boxes = [
        "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(s.offsets, s.sizes)) + f"]@{s.placement.rank}"
        for s in layout.shards[:most]
    ]
    more = f" ... {len(layout.shards) - most} more" if len(layout.shards) > most else ""
    pending = f" partial {layout.partial}" if layout.partial else ""
    pending += " over terms" if layout.terms is not None else ""
    return f"shape {layout.shape}{pending}: {' '.join(boxes)}{more} #{_layout_digest(layout)}"
