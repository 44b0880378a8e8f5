"""Plan sizes of huge layouts are exact Python ints: nothing wraps around in int64."""

from __future__ import annotations

import pytest

import fshard
from fshard import Chunk, Mesh, Named, Partial, Replicated

N = 2**62  # a 1-D extent whose copies on three ranks add up past 2**63
SIDE = 2**40  # a 2-D shape of 2**80 elements: one box is past 2**63 by itself

CASES = {
    # (source spec, destination spec, shape, elements sent)
    "1-D chunk to three replicas": (Chunk(0, [0, 1]), Replicated([0, 1, 2]), (N,), 3 * N - N),
    "1-D replicas to a chunk": (Replicated([0, 1]), Chunk(0, [2, 3]), (N,), N),
    "2-D rows to columns": (Chunk(0, [0, 1]), Chunk(1, [0, 1]), (SIDE, SIDE), 2**80 // 2),
    "2-D rows to a replica": (Chunk(0, [0, 1]), Replicated([0, 1, 2]), (SIDE, SIDE), 2**80 * 2),
    "2-D pending sum to columns": (
        Partial(Replicated([0, 1]), "sum"),
        Chunk(1, [0, 1]),
        (SIDE, SIDE),
        2**80,  # each element: one of its two summands crosses
    ),
    "2-D pending sum to three replicas": (
        Partial(Replicated([0, 1, 2]), "sum"),
        Replicated([0, 1, 2]),
        (SIDE, SIDE),
        4 * 2**80,  # |S| + |D| - 2 per element
    ),
    "2-D pending sum over y, replicated over x, to rows": (
        Partial(Named(Mesh((2, 2)), (None,)), over="y"),
        Chunk(0, [0, 1, 2, 3]),
        (SIDE, SIDE),
        2**80,  # two summands, each read from one of its replicas: one crosses
    ),
    "2-D pending sum over y, replicated over x, to four replicas": (
        Partial(Named(Mesh((2, 2)), (None,)), over="y"),
        Replicated([0, 1, 2, 3]),
        (SIDE, SIDE),
        4 * 2**80,  # summands + |D| - 2 per element
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_elements_sent_of_huge_layouts_are_exact(case):
    src, dst, shape, sent = CASES[case]
    p = fshard.plan(src.layout(shape), dst.layout(shape))
    assert p.min_elements_sent == sent
    assert p.elements_sent == sent
    assert type(p.min_elements_sent) is int
    assert type(p.elements_sent) is int
    assert p.bytes_sent(8) == 8 * sent
    assert int(p.traffic().sum()) == sent
    assert f"{sent} elements sent (minimum {sent})" in repr(p)


def test_transfer_numel_of_a_huge_box_is_exact():
    p = fshard.plan(Chunk(0, [0, 1]).layout((SIDE, SIDE)), Chunk(1, [0, 1]).layout((SIDE, SIDE)))
    assert sorted(t.numel for t in p) == [2**78] * 4
    assert sum(int(n) for n in p.numel) == 2**80
