"""Code paths on CUDA tensors (local backend): tree moves, closures, refused writes, Hugging Face files.

Skipped on a machine without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import fshard

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"),
]

GPU = ["rank:0/cuda:0", "rank:1/cuda:0", "rank:2/cuda:0", "rank:3/cuda:0"]


def test_a_tree_of_cuda_arrays_moves_as_one_to_the_values_of_its_leaves():
    g = torch.Generator().manual_seed(0)
    tree = {
        "w": fshard.shard(torch.randn(64, 32, generator=g).cuda(), fshard.Chunk(0, GPU)),
        "b": fshard.shard(torch.randn(32, generator=g).cuda(), fshard.Chunk(0, GPU)),
        "h": fshard.shard(torch.randn(8, 8, generator=g, dtype=torch.float64).cuda(), fshard.Chunk(0, GPU[:2])),
    }
    moved = fshard.reshard(tree, fshard.Replicated(GPU))
    for name, a in tree.items():
        assert moved[name].addressable_data[0].device.type == "cuda"
        assert torch.equal(fshard.gather(moved[name]), fshard.gather(a))
    got = fshard.gather(tree)
    assert torch.equal(got["w"], fshard.gather(tree["w"]))


def test_a_fully_sharded_step_on_cuda_gives_the_dense_gradient():
    torch.manual_seed(0)
    w = torch.randn(16, 16, dtype=torch.float64, device="cuda")
    x = torch.randn(8, 16, dtype=torch.float64, device="cuda")
    params = fshard.shard(w, fshard.Chunk(0, GPU))
    for t in params.addressable_data:
        t.requires_grad_()
    body = fshard.shard_map(
        lambda xb, wb: torch.tanh(xb @ wb).sum()[None],
        in_specs=(fshard.Chunk(0, GPU), fshard.Replicated(GPU)),
        out_specs=fshard.Partial(fshard.Replicated(GPU)),
    )
    fshard.gather(body(fshard.shard(x, fshard.Chunk(0, GPU)), params)).sum().backward()
    dense = w.clone().requires_grad_()
    torch.tanh(x @ dense).sum().backward()
    got = torch.cat([t.grad for t in params.addressable_data])
    assert torch.allclose(got, dense.grad, rtol=1e-12, atol=1e-12)


def test_a_closed_over_cuda_tensor_gets_the_sum_of_its_uses():
    v = torch.tensor([1.5, -2.0], device="cuda", requires_grad=True)
    rows = fshard.shard(torch.arange(8.0, device="cuda").reshape(4, 2), fshard.Chunk(0, GPU))
    fshard.gather(fshard.map_local(lambda t: t * v, rows)).sum().backward()
    assert v.grad.tolist() == [12.0, 16.0]


def test_a_write_into_a_cuda_block_is_refused_before_it_happens():
    a = fshard.shard(torch.arange(8.0, device="cuda"), fshard.Chunk(0, GPU))
    before = [t.clone() for t in a.addressable_data]
    with pytest.raises(fshard.SpecError, match="aten::mul_"):
        fshard.map_local(lambda t: t.mul_(10), a)
    assert all(torch.equal(x, y) for x, y in zip(a.addressable_data, before))


def test_hugging_face_save_from_and_load_into_cuda_arrays(tmp_path):
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    dense = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g).to(torch.bfloat16)}
    tree = {
        "w": fshard.shard(dense["w"].cuda(), fshard.Chunk(0, GPU)),
        "b": fshard.shard(dense["b"].cuda(), fshard.Replicated(GPU)),
    }
    fshard.save_safetensors(tmp_path / "hf", tree)
    back = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(back[n], t) for n, t in dense.items())
    loaded = fshard.load(tmp_path / "hf", specs={"w": fshard.Chunk(1, GPU), "b": fshard.Chunk(0, GPU[:2])})
    assert loaded["w"].addressable_data[0].device.type == "cuda"
    assert all(torch.equal(fshard.gather(loaded[n]).cpu(), t) for n, t in dense.items())
