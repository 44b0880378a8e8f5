"""shard_map and map_local refuse out_specs whose replicas the arguments do not imply.

A result is known to be equal on two placements only where every argument gives them
copies of one block; a claim of replicas elsewhere would build an array whose copies
disagree (its value would depend on which copy a movement reads).
"""

from __future__ import annotations

import pytest
import torch

import fshard

MESH = fshard.Mesh((2, 2))
X = torch.arange(16.0).reshape(4, 4)


def _double(in_spec, out_spec, **kw):
    return fshard.shard_map(lambda t: 2 * t, in_specs=in_spec, out_specs=out_spec, **kw)


def test_a_claim_of_replicas_along_an_axis_the_argument_splits_is_refused_naming_the_axis():
    with pytest.raises(fshard.SpecError, match="replicas along mesh axis 'x'") as info:
        _double(fshard.Named(MESH, ("x", "y")), fshard.Named(MESH, (None, "y")))(X)
    text = str(info.value)
    assert "argument 0" in text
    assert "over=('x',)" in text
    assert "check_vma=False" in text


def test_the_refused_claim_would_have_built_replicas_that_disagree():
    # With the check off, the array is what the claim says: its two copies along x differ.
    y = _double(fshard.Named(MESH, ("x", "y")), fshard.Named(MESH, (None, "y")), check_vma=False)(X)
    copies = [s.data for s in y.addressable_shards if s.meta.offsets == (0, 0)]
    assert len(copies) == 2
    assert not torch.equal(copies[0], copies[1])


@pytest.mark.parametrize(
    ("in_spec", "out_spec"),
    [
        (fshard.Named(MESH, ("x", None)), fshard.Named(MESH, ("x", None))),  # copies along y: replicas
        (fshard.Named(MESH, ("x", "y")), fshard.Named(MESH, ("x", "y"))),
        (fshard.Replicated([0, 1, 2, 3]), fshard.Replicated([0, 1, 2, 3])),
        (fshard.Named(MESH, ("x", "y")), fshard.Partial(fshard.Named(MESH, (None, "y")))),  # summands: no claim
    ],
)
def test_claims_that_the_arguments_imply_are_accepted(in_spec, out_spec):
    y = _double(in_spec, out_spec)(X)
    assert y.layout == out_spec.layout(y.shape)


def test_every_argument_counts():
    both = fshard.shard_map(
        lambda a, b: a + b.sum(),
        in_specs=(fshard.Named(MESH, ("x", None)), fshard.Named(MESH, (None, "y"))),
        out_specs=fshard.Named(MESH, ("x", None)),
    )
    with pytest.raises(fshard.SpecError, match="argument 1 gives those placements different blocks"):
        both(X, X)


def test_map_local_with_out_spec_is_checked_too():
    a = fshard.shard(X, fshard.Chunk(0, [0, 1]))
    with pytest.raises(fshard.SpecError, match=r"shard_map\(\.\.\., check_vma=False\)"):
        fshard.map_local(lambda t: t, a, out_spec=fshard.Replicated([0, 1]))


def test_empty_blocks_claim_nothing():
    spec = fshard.Chunk(0, [0, 1, 2, 3])  # 2 rows on 4 ranks: two empty blocks
    y = fshard.shard_map(lambda t: t + 1, in_specs=spec, out_specs=spec)(torch.ones(2, 3))
    assert torch.equal(fshard.gather(y), torch.full((2, 3), 2.0))


def test_check_vma_must_be_a_bool():
    with pytest.raises(TypeError, match="check_vma must be a bool"):
        fshard.shard_map(lambda t: t, in_specs=None, out_specs=None, check_vma="no")
