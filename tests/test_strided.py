"""The layout of ``_StridedShard`` DTensors, against DTensor's own splitting of an index tensor (one process)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor.placement_types import Shard, _StridedShard

import fshard
from fshard._interop.strided import Split, local_runs, strided_layout


def _dtensor_indices(
    shape: tuple[int, ...], mesh: tuple[int, ...], splits: list[Split], coord: tuple[int, ...]
) -> list[list[int]]:
    """Per dim, the global indices DTensor's placements leave at ``coord``: its ``_split_tensor``, left to right."""
    idx = [torch.arange(n) for n in shape]
    for m, (kind, dim, factor) in enumerate(splits):
        if kind != "replicate":
            p = Shard(0) if kind == "shard" else _StridedShard(0, split_factor=factor)
            idx[dim] = p._split_tensor(idx[dim], mesh[m], with_padding=False, contiguous=True)[0][coord[m]]
    return [t.tolist() for t in idx]


def _random_case(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], list[Split]]:
    ndim, mdims = rng.randint(1, 3), rng.randint(1, 3)
    shape = tuple(rng.randint(0, 9) for _ in range(ndim))
    mesh = tuple(rng.randint(1, 3) for _ in range(mdims))
    splits: list[Split] = []
    for _ in range(mdims):
        kind, dim = rng.choice(["shard", "strided", "replicate"]), rng.randrange(ndim)
        splits.append(
            ("replicate", -1, 1) if kind == "replicate" else (kind, dim, rng.randint(1, 4) if kind == "strided" else 1)
        )
    return shape, mesh, splits


@pytest.mark.parametrize("seed", range(4))
def test_local_indices_match_dtensor_splitting(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        shape, mesh, splits = _random_case(rng)
        for coord in itertools.product(*(range(n) for n in mesh)):
            runs = local_runs(shape, mesh, splits, coord)
            got = [[i for s, n in r for i in range(s, s + n)] for r in runs]
            assert got == _dtensor_indices(shape, mesh, splits, coord), (shape, mesh, splits, coord)


@pytest.mark.parametrize("seed", range(2))
def test_the_layout_holds_each_rank_s_local_tensor(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(100):
        shape, mesh_shape, splits = _random_case(rng)
        layout, at = strided_layout(shape, fshard.Mesh(mesh_shape), splits)  # a valid layout: checked when built
        full = np.arange(int(np.prod(shape))).reshape(shape)
        for flat, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
            local = full[np.ix_(*_dtensor_indices(shape, mesh_shape, splits, coord))]  # what DTensor holds there
            for i in layout.indices_on(flat):
                s = layout.shards[i]
                box = full[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))]
                view = local[tuple(slice(int(o), int(o) + n) for o, n in zip(at[i], s.sizes))]
                assert np.array_equal(box, view)
            held = sum(layout.shards[i].numel for i in layout.indices_on(flat))
            assert held == local.size


def test_one_rank_holds_several_boxes() -> None:
    layout, at = strided_layout((9,), fshard.Mesh((4,)), [("strided", 0, 2)])
    assert [(s.offsets, s.sizes) for s in layout.shards_on(0)] == [((0,), (2,)), ((5,), (1,))]
    assert [(s.offsets, s.sizes) for s in layout.shards_on(3)] == [((8,), (1,))]  # the first part has none left
    assert at[: len(layout.shards_on(0))].tolist() == [[0], [2]]
