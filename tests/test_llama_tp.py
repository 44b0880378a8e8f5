"""examples/llama_tp.py: a transformers Llama (2 query heads and 1 key-value head per placement) trained TP+DP.

The unmodified Llama runs through ``fshard.apply_module`` with ``fshard.tensor_parallel``
rules on a 2 x 2 mesh, on the local backend and on the 4 Gloo processes of the pool. Its
losses and parameters agree with the dense Llama to ``llama_tp.TOL`` (transformers'
RMSNorm computes in float32); with the norms computing in float64 they agree to float64
rounding, which shows that the remaining difference is the norms' float32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_examples import example

import fshard

pytest.importorskip("transformers")

R4 = [0, 1, 2, 3]


def _llama() -> Any:
    return example("llama_tp")


def test_four_steps_on_a_2x2_mesh_match_the_dense_llama_locally():
    result = _llama().check(R4)
    assert result["mesh"] == (2, 2)
    assert result["loss_diff"] <= _llama().TOL
    assert result["param_diff"] <= _llama().TOL
    assert result["ok"]


def test_each_placement_holds_half_the_heads():
    llama = _llama()
    mesh = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
    params, buffers = fshard.shard_module(llama.make_model(), fshard.tensor_parallel(mesh, llama.PLAN))
    attn = "model.layers.0.self_attn"
    assert {tuple(s.data.shape) for s in params[f"{attn}.q_proj.weight"].addressable_shards} == {(32, 64)}
    assert {tuple(s.data.shape) for s in params[f"{attn}.k_proj.weight"].addressable_shards} == {(16, 64)}
    assert {tuple(s.data.shape) for s in params[f"{attn}.o_proj.weight"].addressable_shards} == {(64, 32)}
    assert {tuple(s.data.shape) for s in params["model.layers.1.mlp.down_proj.weight"].addressable_shards} == {(64, 64)}
    assert params["model.norm.weight"].layout.is_fully_replicated
    assert buffers["model.rotary_emb.inv_freq"].layout.is_fully_replicated


class _Float64Norm(torch.nn.Module):
    """RMSNorm in the input's dtype (transformers' LlamaRMSNorm computes in float32)."""

    def __init__(self, norm: Any) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _float64_norms() -> Any:
    model = _llama().make_model()
    for name, sub in list(model.named_modules()):
        if type(sub).__name__ == "LlamaRMSNorm":
            owner, _, local = name.rpartition(".")
            setattr(model.get_submodule(owner), local, _Float64Norm(sub))
    return model


def test_with_float64_norms_the_llama_matches_to_float64_rounding():
    llama = _llama()
    losses, params = llama.program(R4, _float64_norms())
    want_losses, want = llama.dense(_float64_norms())
    assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) <= 1e-12
    for name, a in params.items():
        assert torch.allclose(fshard.gather(a), want[name], rtol=0, atol=1e-12), name


def _on_gloo() -> dict[str, Any]:
    return _llama().check(range(dist.get_world_size()))


@pytest.mark.multiprocess
def test_four_steps_on_4_gloo_processes_match_the_dense_llama(dist_pool):
    local = _llama().check(R4)
    for rank, result in enumerate(dist_pool.run(_on_gloo, timeout=300)):
        assert result["ok"], f"rank {rank}: {result['loss_diff']}, {result['param_diff']}"
        assert max(abs(a - b) for a, b in zip(result["losses"], local["losses"], strict=True)) <= 1e-12
