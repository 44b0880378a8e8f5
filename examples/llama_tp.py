"""A Hugging Face ``transformers`` Llama trained with tensor and data parallelism through fshard's module API.

The Llama is built from a config (2 layers, hidden 64, 4 attention heads over 2 key-value
heads, vocabulary 128; random weights, nothing downloaded) and runs unmodified:
``fshard.tensor_parallel`` splits ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and
``up_proj`` by output feature over ``tp`` (each placement holds 2 of the 4 query heads and 1
of the 2 key-value heads: transformers reshapes with ``-1`` heads and repeats key-value
heads by the ratio, which local heads keep), and ``o_proj`` and ``down_proj`` by input
feature (their products are summed over ``tp`` before the bias); embeddings, norms, the
rotary tables and the head stay whole. Batch rows are split over ``dp``.

The losses and parameters of a few SGD steps in float64 are compared with the dense Llama.
They agree to about 1e-9, not to float64 rounding: transformers' ``LlamaRMSNorm`` computes
in float32 whatever the model's dtype, so every gradient that flows through a norm is
rounded to float32, and the tensor-parallel sums' different (float64) order can move a
float32 rounding by one unit. The tolerance is ``TOL``.

    python examples/llama_tp.py                  # local backend: 1, 2 (1 x 2) and 4 ranks (2 x 2)
    python examples/llama_tp.py --world 4        # 4 Gloo processes: dp=2, tp=2

It exits with status 1 if a check fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import fshard

VOCAB, SEQ, BATCH, STEPS, LR = 128, 8, 4, 4, 0.1
TOL = 1e-8  # float32 inside LlamaRMSNorm: see the module's docstring
CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, use_cache=False,
)  # fmt: skip


def make_model() -> LlamaForCausalLM:
    """The same float64 Llama on every rank."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: token ids and next tokens, the same on every rank."""
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def loss_sum(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of a block of rows, as a 1-element tensor."""
    return F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), targets.flatten(), reduction="sum")[None]


# -- the program ----------------------------------------------------------------------------

PLAN = {
    "*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
    "*.gate_proj": "colwise", "*.up_proj": "colwise",
    "*.o_proj": "rowwise", "*.down_proj": "rowwise",
}  # fmt: skip


def program(ranks: Sequence[int], model: torch.nn.Module | None = None) -> tuple[list[float], dict[str, Any]]:
    """TP+DP training on a (dp, tp) mesh of ``ranks`` (tp=2 where their count is even): losses and parameters."""
    tp = 2 if len(ranks) % 2 == 0 else 1
    mesh = fshard.Mesh((len(ranks) // tp, tp), ranks=list(ranks), axis_names=("dp", "tp"))
    rules = fshard.tensor_parallel(mesh, PLAN)
    model = make_model() if model is None else model
    params, buffers = fshard.shard_module(model, rules)
    opt = torch.optim.SGD([t for a in params.values() for t in a.addressable_data], lr=LR)
    losses = []
    for step in range(STEPS):
        ids, targets = batch(step)
        loss, buffers = fshard.apply_module(
            model, params, buffers, fshard.shard(ids, rules.rows), fshard.shard(targets, rules.rows),
            method=loss_sum, out_specs=rules.summed, rules=rules,
        )  # fmt: skip
        loss = fshard.gather(loss)[0] / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, params


# -- the check ------------------------------------------------------------------------------


def dense(model: torch.nn.Module | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps on the unsharded Llama: losses and final parameters."""
    model = make_model() if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, targets = batch(step)
        loss = loss_sum(model, ids, targets)[0] / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def check(ranks: Sequence[int]) -> dict[str, Any]:
    """TP+DP on ``ranks`` against the dense Llama: the largest differences of losses and of parameters."""
    losses, params = program(ranks)
    want_losses, want = dense()
    with torch.no_grad():
        param_diff = max(float((fshard.gather(a) - want[n]).abs().max()) for n, a in params.items())
    loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses))
    tp = 2 if len(ranks) % 2 == 0 else 1
    return {
        "mesh": (len(ranks) // tp, tp),
        "losses": losses,
        "dense": want_losses,
        "loss_diff": loss_diff,
        "param_diff": param_diff,
        "ok": loss_diff <= TOL and param_diff <= TOL,
    }


def report(result: dict[str, Any]) -> str:
    """One line per check."""
    dp, tp = result["mesh"]
    verdict = "ok" if result["ok"] else "MISMATCH"
    return (
        f"dp={dp}, tp={tp}: losses {[round(x, 9) for x in result['losses']]}, largest difference from the dense "
        f"Llama {result['loss_diff']:.1e} (losses), {result['param_diff']:.1e} (parameters): {verdict}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check on the local backend, on spawned Gloo processes (``--world N``), or under torchrun."""
    from fshard.testing.launch import check_main

    return check_main(check, report, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
