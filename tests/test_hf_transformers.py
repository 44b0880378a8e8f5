"""A transformers Llama (random weights from a config, nothing downloaded) through fshard and back.

``save_pretrained(max_shard_size="100KB")`` writes a sharded folder; ``fshard.load`` reads
it into a tensor-parallel layout (q/k/v/gate/up split by output rows, o/down by input
columns, embeddings and norms replicated), on the local backend and on 4 Gloo
processes; ``save_safetensors`` writes it back, and ``from_pretrained`` gives the same
logits. transformers is imported by the test functions only: the Gloo workers run the
module-level functions below without it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import fshard
from fshard._checkpoint import _safetensors
from fshard.backends.local import LocalBackend

R = [0, 1, 2, 3]
COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
ROW = ("o_proj.weight", "down_proj.weight")
TIMEOUT = 180


def tp_spec(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    """Megatron-style tensor parallelism over ranks ``R``."""
    if name.endswith(COLUMN):
        return fshard.Chunk(0, R)
    if name.endswith(ROW):
        return fshard.Chunk(1, R)
    return fshard.Replicated(R)


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128,
    )  # fmt: skip


def _model() -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).eval()


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model = _model()
    folder = tmp_path_factory.mktemp("llama") / "hf"
    model.save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    assert (folder / "model.safetensors.index.json").is_file()
    return model, folder


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["save_pretrained", "save_file"])
def test_a_folder_with_model_safetensors_beside_an_index_reads_as_transformers_does(
    llama: tuple[Any, Path], tmp_path: Path, how: str
) -> None:
    """A sharded save, then a newer one as one file: transformers reads model.safetensors first, and so does fshard.

    ``save_pretrained`` in one file leaves the older save's index behind (its shard files removed);
    ``save_file`` leaves the older shards too.
    """
    import shutil

    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    _, sharded = llama
    folder = tmp_path / "hf"
    shutil.copytree(sharded, folder)
    torch.manual_seed(1)
    newer = LlamaForCausalLM(_config()).eval()
    if how == "save_pretrained":
        newer.save_pretrained(folder)
    else:
        save_file({k: v.contiguous() for k, v in newer.state_dict().items()}, folder / "model.safetensors")
    assert (folder / "model.safetensors").is_file()
    assert (folder / "model.safetensors.index.json").is_file()
    theirs = _state(LlamaForCausalLM.from_pretrained(folder))
    ours = fshard.load(folder)
    assert set(ours) <= set(theirs)
    assert all(torch.equal(t, theirs[name]) for name, t in ours.items())
    assert torch.equal(ours["model.embed_tokens.weight"], newer.state_dict()["model.embed_tokens.weight"])


IDS = torch.tensor([[1, 5, 9, 33, 2, 127, 64], [0, 3, 3, 8, 100, 12, 7]])


def _mlp(x: torch.Tensor, gate: Any, up: Any, down: Any) -> torch.Tensor:
    """Layer 0's MLP as a shard_map: column-parallel gate and up, row-parallel down, one sum at the end."""
    block = fshard.shard_map(
        lambda xb, g, u, d: (F.silu(xb @ g.T) * (xb @ u.T)) @ d.T,
        in_specs=(fshard.Replicated(R), fshard.Chunk(0, R), fshard.Chunk(0, R), fshard.Chunk(1, R)),
        out_specs=fshard.Partial(fshard.Replicated(R)),
    )
    return fshard.gather(block(x, gate, up, down))


def test_local_backend_tensor_parallel_load_forward_and_save(llama: tuple[Any, Path], tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    model, folder = llama
    state = model.state_dict()
    _safetensors.counters.reset()
    backend = LocalBackend()
    arrays = fshard.load(folder, specs=tp_spec, backend=backend)
    sent = backend.counters.elements_sent  # bytes: the load moves a uint8 array
    assert set(arrays) == set(state)
    assert {n: _sha(fshard.gather(x)) for n, x in arrays.items()} == {n: _sha(t) for n, t in state.items()}
    assert arrays["model.layers.0.self_attn.q_proj.weight"].layout == fshard.Chunk(0, R).layout((64, 64))
    assert _safetensors.counters.bytes_read == sum(t.nbytes for t in state.values())  # replicas read once
    replicated = sum(t.nbytes for n, t in state.items() if not n.endswith(COLUMN + ROW))
    assert sent == 3 * replicated  # then sent to the 3 other holders

    # The same model with its weights put back from the gathered arrays gives the same logits, bit for bit.
    again = LlamaForCausalLM(_config()).eval()
    again.load_state_dict({n: fshard.gather(x) for n, x in arrays.items()})
    assert torch.equal(_logits(again, IDS), _logits(model, IDS))

    # Layer 0's MLP computed tensor-parallel from the loaded shards equals the dense block.
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    p = "model.layers.0.mlp."
    sharded = _mlp(x, arrays[p + "gate_proj.weight"], arrays[p + "up_proj.weight"], arrays[p + "down_proj.weight"])
    with torch.no_grad():
        assert torch.allclose(sharded, model.model.layers[0].mlp(x), rtol=1e-5, atol=1e-6)

    out = tmp_path / "out"
    fshard.save_safetensors(out, arrays, max_shard_size="100KB")
    model.config.save_pretrained(out)  # into the existing folder, beside the weights
    for f in out.glob("*.safetensors"):
        assert all(_sha(t) == _sha(state[n]) for n, t in load_file(f).items())
    assert torch.equal(_logits(LlamaForCausalLM.from_pretrained(out).eval(), IDS), _logits(model, IDS))


def _gloo_load_mlp_save(folder: str, out: str, x: torch.Tensor) -> dict[str, Any]:
    _safetensors.counters.reset()
    arrays = fshard.load(folder, specs=tp_spec)
    read = _safetensors.counters.bytes_read
    shas = {n: _sha(fshard.gather(a)) for n, a in arrays.items()}
    p = "model.layers.0.mlp."
    mlp = _mlp(x, arrays[p + "gate_proj.weight"], arrays[p + "up_proj.weight"], arrays[p + "down_proj.weight"])
    mine = sum(t.nbytes for a in arrays.values() for t in a.addressable_data)
    fshard.save_safetensors(out, arrays, max_shard_size="100KB")
    return {"read": read, "mine": mine, "sha": shas, "mlp": mlp}


def test_four_gloo_ranks_tensor_parallel_load_forward_and_save(
    dist_pool: Any, llama: tuple[Any, Path], tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    model, folder = llama
    state = model.state_dict()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    out = tmp_path / "out"
    results = dist_pool.run(_gloo_load_mlp_save, str(folder), str(out), x, timeout=TIMEOUT)
    expected = {n: _sha(t) for n, t in state.items()}
    assert all(r["sha"] == expected for r in results)
    assert sum(r["read"] for r in results) == sum(t.nbytes for t in state.values())
    sharded = sum(t.nbytes for n, t in state.items() if n.endswith(COLUMN + ROW))
    replicated = sum(t.nbytes for n, t in state.items()) - sharded
    assert sum(r["mine"] for r in results) == sharded + 4 * replicated
    with torch.no_grad():
        dense = model.model.layers[0].mlp(x)
    assert all(torch.allclose(r["mlp"], dense, rtol=1e-5, atol=1e-6) for r in results)
    assert all(torch.equal(r["mlp"], results[0]["mlp"]) for r in results)

    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "model.safetensors.index.json").is_file()
    model.config.save_pretrained(out)
    for f in out.glob("*.safetensors"):
        assert all(_sha(t) == expected[n] for n, t in load_file(f).items())
    assert torch.equal(_logits(LlamaForCausalLM.from_pretrained(out).eval(), IDS), _logits(model, IDS))
