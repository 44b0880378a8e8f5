"""Layouts near the int64 bound: validation and ``numel`` are exact, larger extents are refused."""

from __future__ import annotations

import re

import numpy as np
import pytest

import fshard
from fshard import Layout, ShardMeta
from fshard._base.boxes import row_keys, unique_rows

N = 2**63 - 1  # MAX_EXTENT: the largest extent, offset or size


@pytest.mark.parametrize(
    ("shape", "boxes"),
    [
        ((10, N), [((0, 0), (2, N)), ((2, 0), (8, N))]),
        ((N, N), [((0, 0), (N // 2, N)), ((N // 2, 0), (N - N // 2, N))]),
        ((3, N), [((0, 0), (3, 5)), ((0, 5), (3, N - 5))]),
        ((N,), [((0,), (N,)), ((0,), (N,))]),  # replicas
        ((4,), [((0,), (4,)), ((N,), (0,))]),  # an empty box at the largest offset
    ],
    ids=["rows-of-long-rows", "halves-of-the-largest", "columns", "replicas", "empty-far-away"],
)
def test_valid_tilings_near_int64_are_accepted(shape, boxes):
    lay = Layout(shape, [ShardMeta(o, s, k) for k, (o, s) in enumerate(boxes)])
    assert lay.shape == shape


@pytest.mark.parametrize(
    ("shape", "boxes", "message"),
    [
        ((9, N), [((0, 0), (2, N)), ((4, 0), (5, N))], "do not cover element (2, 0) of shape (9, 9223372036854775807)"),
        ((3, N), [((0, 0), (3, 5)), ((0, 6), (3, N - 6))], "do not cover element (0, 5)"),
        (
            (N, N),
            [((0, 0), (N // 2 + 1, N)), ((N // 2, 0), (N - N // 2, N))],
            "overlap at element (4611686018427387903, 0)",
        ),
        ((10,), [((0,), (10,)), ((2**62,), (2**62 + 5,))], "extends past shape (10,) in dim 0"),
    ],
    ids=["gap-in-long-rows", "gap-in-columns", "overlap", "sum-past-int64"],
)
def test_gaps_overlaps_and_overruns_near_int64_are_caught(shape, boxes, message):
    with pytest.raises(fshard.LayoutError, match=re.escape(message)):
        Layout(shape, [ShardMeta(o, s, k) for k, (o, s) in enumerate(boxes)])


@pytest.mark.parametrize(
    "build",
    [
        lambda: Layout((N + 1,), [ShardMeta((0,), (1,), 0)]),
        lambda: ShardMeta((N + 1,), (0,), 0),
        lambda: ShardMeta((0,), (2**64,), 0),
        lambda: Layout.from_dict({"shape": [2**70], "shards": []}),
    ],
    ids=["shape", "offset", "size", "from-dict"],
)
def test_extents_past_int64_are_a_layout_error(build):
    with pytest.raises(fshard.LayoutError, match=re.escape("past the largest supported extent 2**63 - 1 (int64)")):
        build()


def test_numel_is_exact_past_int64():
    lay = Layout((2**32, 2**32), [ShardMeta((0, 0), (2**32, 2**32), 0)])
    assert lay.numel == 2**64
    assert lay.shards[0].numel == 2**64
    assert Layout((), [ShardMeta((), (), 0)]).numel == 1


def test_row_keys_and_unique_rows_do_not_wrap_near_int64():
    rows = np.array([[0, 0], [N, 0], [0, N], [N, 0]], np.int64)
    assert row_keys(rows) is None  # the radix does not fit: callers fall back to sorting rows
    first, inverse = unique_rows(rows)
    assert rows[first].tolist() == [[0, 0], [0, N], [N, 0]]
    assert inverse.tolist() == [0, 2, 1, 2]
