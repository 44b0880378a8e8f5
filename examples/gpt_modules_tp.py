"""A GPT trained with tensor and data parallelism through fshard's module API, checked against the dense model.

The ranks form a (dp, tp) mesh. ``fshard.tensor_parallel(mesh, PLAN)`` splits the attention's
``q``, ``k``, ``v`` and the MLP's ``fc`` by output feature over ``tp`` (column-parallel) and
``proj`` and ``out`` by input feature (row-parallel: each placement's product is summed over
``tp`` before the bias); embeddings, norms and the head (tied to the token embedding) stay
whole. ``fshard.apply_module`` runs the unmodified ``torch.nn`` GPT on each placement's
blocks: its batch rows (split over ``dp``) and its share of the heads (the attention reshapes
with ``-1`` heads). The program is ``PLAN``, ``program`` and ``train``; it trains a few SGD
steps in float64 and must give the dense model's losses and parameters.

    python examples/gpt_modules_tp.py                  # local backend: 1, 2 (1 x 2) and 4 ranks (2 x 2)
    python examples/gpt_modules_tp.py --world 4        # 4 Gloo processes: dp=2, tp=2
    torchrun --nproc-per-node 4 examples/gpt_modules_tp.py

It exits with status 1 if a check fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import fshard

VOCAB, SEQ, D, HEADS, BLOCKS, BATCH, STEPS, LR = 32, 8, 16, 4, 2, 4, 5, 0.1


class Block(torch.nn.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm and a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.q, self.k, self.v = (torch.nn.Linear(D, D) for _ in range(3))
        self.proj, self.fc, self.out = torch.nn.Linear(D, D), torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 heads: a placement of a tensor-parallel run holds HEADS / tp of them
        q, k, v = (lin(h).view(b, t, -1, D // HEADS).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """Embeddings, blocks, a final norm and a head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, D), torch.nn.Embedding(SEQ, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_model() -> GPT:
    """The same float64 GPT on every rank."""
    torch.manual_seed(0)
    return GPT().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank (each placement uses its rows of it)."""
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_sum(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of a block of rows, as a 1-element tensor."""
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum")[None]


# -- the program ----------------------------------------------------------------------------

PLAN = {
    "*.q": "colwise", "*.k": "colwise", "*.v": "colwise", "*.fc": "colwise",
    "*.proj": "rowwise", "*.out": "rowwise",
}  # fmt: skip


def program(ranks: Sequence[int]) -> tuple[list[float], dict[str, fshard.ShardedArray]]:
    """TP+DP training on a (dp, tp) mesh of ``ranks`` (tp=2 where their count is even): losses and parameters."""
    tp = 2 if len(ranks) % 2 == 0 else 1
    mesh = fshard.Mesh((len(ranks) // tp, tp), ranks=list(ranks), axis_names=("dp", "tp"))
    rules = fshard.tensor_parallel(mesh, PLAN, tp="tp", dp="dp")
    model = make_model()
    params, buffers = fshard.shard_module(model, rules)
    return train(model, rules, params, buffers, range(STEPS)), params


def train(model: torch.nn.Module, rules: Any, params: Any, buffers: Any, steps: range) -> list[float]:
    """SGD steps ``steps`` on ``params`` (laid out by ``rules``); the losses."""
    opt = torch.optim.SGD([t for a in params.values() for t in a.addressable_data], lr=LR)
    losses = []
    for step in steps:
        tokens, targets = batch(step)
        loss, buffers = fshard.apply_module(
            model, params, buffers, fshard.shard(tokens, rules.rows), fshard.shard(targets, rules.rows),
            method=loss_sum, out_specs=rules.summed, rules=rules,
        )  # fmt: skip
        loss = fshard.gather(loss)[0] / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# -- the check ------------------------------------------------------------------------------


def dense(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps on the unsharded model: losses and final parameters."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step)
        loss = loss_sum(model, tokens, targets)[0] / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def check(ranks: Sequence[int]) -> dict[str, Any]:
    """TP+DP on ``ranks`` against the dense model: losses and parameters after the steps."""
    losses, params = program(ranks)
    want_losses, want = dense()
    with torch.no_grad():
        got = {name: fshard.gather(a) for name, a in params.items()}
    bad = [n for n in got if not torch.allclose(got[n], want[n], rtol=0, atol=1e-12)]
    close = all(abs(a - b) <= 1e-12 for a, b in zip(losses, want_losses))
    tp = 2 if len(ranks) % 2 == 0 else 1
    return {"mesh": (len(ranks) // tp, tp), "losses": losses, "dense": want_losses, "bad": bad, "ok": close and not bad}


def report(result: dict[str, Any]) -> str:
    """One line per check."""
    verdict = "ok" if result["ok"] else f"MISMATCH {result['bad']}"
    dp, tp = result["mesh"]
    return f"dp={dp}, tp={tp}: losses {[round(x, 9) for x in result['losses']]} (dense alike): {verdict}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check on the local backend, on spawned Gloo processes (``--world N``), or under torchrun."""
    from fshard.testing.launch import check_main

    return check_main(check, report, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
