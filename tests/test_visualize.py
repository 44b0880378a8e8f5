"""Layout pictures to scale, in colour on a terminal, and reprs that rebuild the value."""

from __future__ import annotations

import itertools
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard
from fshard import Chunk, Explicit, Layout, Mesh, Named, Partial, Replicated
from fshard._layout.show import draw
from fshard.testing import strategies as fst

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _bands(picture: str) -> list[int]:
    """Lines between the horizontal borders of a one-column picture."""
    out, n = [], 0
    for line in picture.splitlines()[1:]:
        if line.startswith("+"):
            out.append(n)
            n = 0
        else:
            n += 1
    return out


def _named_ranks(text: str) -> set[int]:
    """The ranks a picture names, ``r0-3`` read as 0, 1, 2, 3."""
    out: set[int] = set()
    for a, b in re.findall(r"\br(\d+)(?:-(\d+))?", text):
        out.update(range(int(a), int(b or a) + 1))
    return out


# -- to scale -------------------------------------------------------------------------------


def test_rows_of_3_3_3_1_draw_as_bands_of_3_3_3_1_lines():
    assert _bands(Chunk(0, [0, 1, 2, 3]).layout((10, 20)).visualize()) == [3, 3, 3, 1]


def test_rows_of_3_3_3_1_keep_their_proportions_in_a_narrow_picture():
    """At width 24 the usual height (width / 4 lines) holds 4 bands of one line: the picture grows instead."""
    assert Chunk(0, [0, 1, 2, 3]).layout((10, 6)).visualize(width=24) == "\n".join(
        [
            "+--------------------+",
            "|                    |",
            "|         r0         |",
            "|                    |",
            "+--------------------+",
            "|                    |",
            "|         r1         |",
            "|                    |",
            "+--------------------+",
            "|                    |",
            "|         r2         |",
            "|                    |",
            "+--------------------+",
            "|         r3         |",
            "+--------------------+",
        ]
    )


def test_columns_of_3_3_3_1_keep_their_proportions():
    one_d = Chunk(0, [0, 1, 2, 3]).layout((10,)).visualize(width=60).splitlines()
    two_d = Chunk(1, [0, 1, 2, 3]).layout((6, 10)).visualize(width=48).splitlines()
    assert _widths(one_d[0]) == [17, 17, 17, 5]
    assert _widths(two_d[0]) == [13, 13, 13, 5]  # 13.5, 13.5, 13.5, 4.5 rounded
    assert _bands("\n".join(two_d)) == [11]


def test_thin_bands_keep_one_line_past_the_tallest_picture():
    """Rows of 1000 and 1 cannot both be to scale within 60 lines: the thin one keeps its line."""
    text = Explicit([((0, 0), (1000, 4), 0), ((1000, 0), (1, 4), 1)]).layout((1001, 4)).visualize(width=60)
    assert _bands(text) == [57, 1]
    assert len(text.splitlines()) == 61


def _widths(border: str) -> list[int]:
    return [len(s) for s in border.strip("+").split("+")]


def _fits_one_scale(sizes: list[int], extents: list[int], least: int) -> bool:
    """Whether one scale makes every size its extent times the scale, rounded, or ``least`` where that is less."""
    lo, hi = 0.0, float("inf")
    for size, extent in zip(sizes, extents):
        if size < least:
            return False
        hi = min(hi, (size + 0.5) / extent)
        if size > least:
            lo = max(lo, (size - 0.5) / extent)
    return lo <= hi + 1e-9


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    mesh=st.sampled_from([(1, 4), (2, 2), (3, 2), (4, 1), (2, 3)]),
    width=st.integers(16, 90),
)
def test_bands_are_to_scale_on_every_grid(rows, cols, mesh, width):
    """Rows and columns of a grid: one scale per dim gives every band's inside, within rounding."""
    lay = Named(Mesh(mesh), ("x", "y")).layout((rows, cols))
    lines = [line for line in lay.visualize(width=width).splitlines() if line[:1] in "+|"]  # not "(empty shards...)"
    row_cuts = sorted({b for s in lay.shards if s.sizes[0] for b in (s.offsets[0], s.offsets[0] + s.sizes[0])})
    col_cuts = sorted({b for s in lay.shards if s.sizes[1] for b in (s.offsets[1], s.offsets[1] + s.sizes[1])})
    label = max(len(w) for line in lines for w in re.findall(r"r\d+", line))
    heights = _bands("\n".join(line[0] for line in lines))
    assert _fits_one_scale(heights, [b - a for a, b in itertools.pairwise(row_cuts)], 1)
    widths = _widths(lines[0])
    assert _fits_one_scale(widths, [b - a for a, b in itertools.pairwise(col_cuts)], label + 1)
    if (len(col_cuts) - 1) * (label + 2) <= width:  # the labels fit across
        assert max(map(len, lines)) <= width + 1
    assert len(lines) <= max(width + 1, 2 * len(row_cuts) - 1)


def test_columns_are_as_wide_as_their_extent():
    first = Chunk(1, [0, 1, 2, 3]).layout((2, 10)).visualize(width=60).splitlines()[0]
    assert [len(s) for s in first.strip("+").split("+")] == [17, 17, 17, 5]


def test_a_tall_array_draws_tall_and_a_wide_one_wide():
    tall = Chunk(0, [0, 1]).layout((100, 4)).visualize(width=60).splitlines()
    wide = Chunk(0, [0, 1]).layout((4, 100)).visualize(width=60).splitlines()
    assert tall != wide
    assert (len(tall), max(map(len, tall))) == (15, 5)
    assert (len(wide), max(map(len, wide))) == (5, 61)


def test_uneven_boxes_keep_their_proportions():
    lay = Explicit([((0, 0), (6, 3), 0), ((0, 3), (2, 5), 1), ((2, 3), (4, 5), 2), ((2, 3), (4, 5), 3)])
    assert lay.layout((6, 8)).visualize(width=32) == "\n".join(
        [
            "+---------+----------------+",
            "|         |       r1       |",
            "|         |                |",
            "|         +----------------+",
            "|   r0    |                |",
            "|         |     r2 r3      |",
            "|         |                |",
            "|         |                |",
            "+---------+----------------+",
        ]
    )


def test_many_replicas_are_labelled_as_a_range():
    assert "r0-7" in Replicated(range(8)).layout((3, 3)).visualize(width=20)
    assert "r0 r2 r4" in Replicated([0, 2, 4]).layout((3, 3)).visualize(width=20)


def test_a_picture_never_exceeds_its_width_when_labels_fit():
    for lay in (Chunk(1, range(8)).layout((4, 64)), Named(Mesh((2, 4)), ("x", "y")).layout((30, 7))):
        assert max(map(len, lay.visualize(width=40).splitlines())) <= 41


@settings(max_examples=60, deadline=None)
@given(fst.layouts(fst.shapes(min_dims=0, max_dims=4, max_side=9)))
def test_every_layout_draws_and_names_every_rank(layout: Layout):
    text = layout.visualize(width=40)
    assert text.strip()
    if len(layout.shards) <= 16 and 0 not in layout.shape and text[0] == "+":
        assert {s.placement.rank for s in layout.shards} == _named_ranks(text)


# -- N-D, empty, too fine --------------------------------------------------------------------


def test_an_nd_layout_is_drawn_over_the_dims_it_splits():
    lay = Named(Mesh((2, 2)), ("x", None, "y")).layout((4, 3, 6))
    lines = lay.visualize(width=24).splitlines()
    assert lines[0] == "3-D layout of shape (4, 3, 6), drawn over dims 0 and 2; every box spans dim 1 whole:"
    assert lines[1:] == Named(Mesh((2, 2)), ("x", "y")).layout((4, 6)).visualize(width=24).splitlines()


def test_an_nd_layout_split_in_one_dim_is_one_band():
    assert Chunk(1, [0, 1]).layout((4, 4, 4)).visualize(width=20).splitlines() == [
        "3-D layout of shape (4, 4, 4), drawn over dim 1; every box spans dims 0, 2 whole:",
        "+---------+---------+",
        "|   r0    |   r1    |",
        "+---------+---------+",
    ]


def test_an_nd_layout_split_in_three_dims_is_summarised():
    assert Named(Mesh((2, 2, 2)), ("x", "y", "z")).layout((4, 4, 5)).visualize().splitlines() == [
        "<3-D layout of shape (4, 4, 5), 8 shards: its boxes split more than two dims>",
        "  dim 0: blocks of 2, 2",
        "  dim 1: blocks of 2, 2",
        "  dim 2: blocks of 3, 2",
        "  rank 0 holds 1 shard, 12 elements",
        "  rank 1 holds 1 shard, 8 elements",
        "  rank 2 holds 1 shard, 12 elements",
        "  rank 3 holds 1 shard, 8 elements",
        "  rank 4 holds 1 shard, 12 elements",
        "  rank 5 holds 1 shard, 8 elements",
        "  rank 6 holds 1 shard, 12 elements",
        "  rank 7 holds 1 shard, 8 elements",
    ]


def test_an_empty_array_is_one_line():
    assert Chunk(0, [0, 1]).layout((0, 4)).visualize() == "<empty layout of shape (0, 4): no elements; shards on r0 r1>"


def test_a_scalar_is_one_box():
    assert Replicated([0, 1]).layout(()).visualize(width=12) == "\n".join(
        ["+-----------+", "|   r0 r1   |", "+-----------+"]
    )


def test_a_partial_layout_says_what_is_pending():
    text = Partial(Replicated([0, 1]), "max").layout((4, 4)).visualize(width=20)
    assert text.splitlines()[-1] == "(pending max: each element is the max of its copies)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"width": 3}, "visualize() width must be an int of at least 4 characters, got 3."),
        ({"width": 8.5}, "visualize() width must be an int of at least 4 characters, got 8.5."),
        ({"color": "yes"}, "visualize() color must be True, False or 'auto', got 'yes'."),
    ],
    ids=["narrow", "float", "color"],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Chunk(0, [0, 1]).layout((4, 4)).visualize(**kwargs)


# -- colour ----------------------------------------------------------------------------------


def test_color_paints_each_rank_and_keeps_the_text():
    pytest.importorskip("rich")
    lay = Named(Mesh((2, 2)), ("x", "y")).layout((4, 6))
    painted = lay.visualize(width=24, color=True)
    assert ANSI.sub("", painted) == lay.visualize(width=24)
    backgrounds = set(re.findall(r"\x1b\[30;48;5;(\d+)m", painted))
    assert len(backgrounds) == 4


def test_auto_color_is_plain_when_output_is_not_a_terminal(monkeypatch):
    pytest.importorskip("rich")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setattr(sys, "stdout", open("/dev/null", "w"))  # noqa: SIM115
    try:
        lay = Chunk(0, [0, 1]).layout((4, 6))
        assert lay.visualize(color="auto") == lay.visualize()
    finally:
        sys.stdout.close()


def test_color_without_rich_is_plain_text(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.console", None)
    lay = Chunk(0, [0, 1]).layout((4, 6))
    assert lay.visualize(color=True) == lay.visualize()


def test_draw_returns_the_runs_to_colour():
    pic = draw(Chunk(1, [0, 1]).layout((1, 4)), width=12)
    assert pic.lines == ("+-----+-----+", "| r0  | r1  |", "+-----+-----+")
    assert pic.fills == ((1, 1, 6, 0), (1, 7, 12, 1))


# -- reprs -----------------------------------------------------------------------------------


def test_layout_repr_rebuilds_the_layout():
    lay = Explicit([((0, 0), (2, 4), 0), ((2, 0), (2, 4), "rank:1/cuda:1"), ((4, 0), (0, 4), 2)]).layout((4, 4))
    text = repr(lay)
    assert text == (
        "Layout(shape=(4, 4), shards=[((0, 0), (2, 4), 0), ((2, 0), (2, 4), 'rank:1/cuda:1'), ((4, 0), (0, 4), 2)])"
    )
    assert eval(text, {"Layout": Layout}) == lay


def test_partial_layout_repr_names_the_reduction():
    lay = Partial(Replicated([0, 1])).layout((2,))
    assert repr(lay) == "Layout(shape=(2,), shards=[((0,), (2,), 0), ((0,), (2,), 1)], partial='sum')"
    assert eval(repr(lay), {"Layout": Layout}) == lay


def test_array_repr_rebuilds_the_array():
    x = fshard.shard(torch.arange(6, dtype=torch.int32).reshape(2, 3), Chunk(1, [0, 1]))
    text = repr(x)
    assert text == (
        "ShardedArray(shape=(2, 3), dtype=torch.int32, backend=local, layout=Layout(shape=(2, 3), "
        "shards=[((0, 0), (2, 2), 0), ((0, 2), (2, 1), 1)]), values=[[0, 1, 2], [3, 4, 5]])"
    )
    layout = eval(text.split("layout=")[1].split(", values=")[0], {"Layout": Layout})
    values = eval(text.split("values=")[1][:-1])
    again = fshard.shard(torch.tensor(values, dtype=torch.int32), layout)
    assert again.layout == x.layout
    assert torch.equal(fshard.gather(again), fshard.gather(x))


def test_partial_array_repr_shows_each_summand():
    x = fshard.shard(torch.tensor([1.5, 2.0]), Partial(Replicated([0, 1])))
    assert repr(x).endswith("partial='sum'), shard_values=[[1.5, 2.0], [-0.0, -0.0]])")


def test_large_values_and_layouts_are_summarised():
    big = fshard.zeros(Chunk(0, range(65)), 65 * 2)
    assert repr(big) == (
        "ShardedArray(shape=(130,), dtype=torch.float32, backend=local, layout=Layout(shape=(130,), "
        "65 shards on ranks 0-64))"
    )
