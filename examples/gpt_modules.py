"""A GPT trained data parallel and fully sharded through fshard's module API, checked against the dense model.

The GPT ties its head to its token embedding and checkpoints every block
(``torch.utils.checkpoint``, ``use_reentrant=False``). ``program`` is the whole training
program: ``fshard.replicated(ranks)`` makes it data parallel, ``fshard.fully_sharded(ranks)``
fully sharded. Both train a few SGD steps in float64 and must give the dense model's
losses and parameters.

    python examples/gpt_modules.py                      # local backend, 1, 2 and 4 ranks
    python examples/gpt_modules.py --world 4            # 4 Gloo processes on this machine
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import fshard

VOCAB, SEQ, D, HEADS, BLOCKS, BATCH, STEPS, LR = 32, 8, 16, 2, 4, 8, 3, 0.5


class Block(torch.nn.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm and a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.fc, self.out = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """Embeddings, checkpointed blocks, a final norm and a head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, D), torch.nn.Embedding(SEQ, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln(x))


def make_model() -> GPT:
    """The same float64 GPT on every rank."""
    torch.manual_seed(0)
    return GPT().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank (each rank uses its own rows of it)."""
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_sum(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of a block of rows, as a 1-element tensor."""
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum")[None]


# -- the program ----------------------------------------------------------------------------


def program(rules: Any, ranks: Sequence[int]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The training program, data parallel or fully sharded by ``rules``: losses and the final parameters."""
    model = make_model()
    params, buffers = fshard.shard_module(model, rules)
    opt = torch.optim.SGD([t for a in params.values() for t in a.addressable_data], lr=LR)
    rows, summed = fshard.Chunk(0, list(ranks)), fshard.Partial(fshard.Replicated(list(ranks)))
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss, buffers = fshard.apply_module(
            model, params, buffers, fshard.shard(tokens, rows), fshard.shard(targets, rows),
            method=loss_sum, out_specs=summed,
        )  # fmt: skip
        loss = fshard.gather(loss)[0] / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {name: fshard.gather(a) for name, a in params.items()}


# -- the check ------------------------------------------------------------------------------


def dense() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps on the unsharded model."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = loss_sum(model, tokens, targets)[0] / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def _close(a: Any, b: Any) -> bool:
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=0, atol=1e-12)


def check(ranks: Sequence[int]) -> dict[str, Any]:
    """DP and FSDP on ``ranks`` against the dense model: losses and parameters after the steps."""
    want_losses, want = dense()
    result: dict[str, Any] = {"ranks": len(list(ranks)), "dense": want_losses, "bad": []}
    for style, rules in (("DP", fshard.replicated(ranks)), ("FSDP", fshard.fully_sharded(ranks))):
        losses, got = program(rules, ranks)
        result[style] = losses
        if not _close(losses, want_losses) or any(not _close(got[n], want[n]) for n in got):
            result["bad"].append(style)
    result["ok"] = not result["bad"]
    return result


def report(result: dict[str, Any]) -> str:
    """One line per check."""
    verdict = "ok" if result["ok"] else f"MISMATCH in {result['bad']}"
    return f"{result['ranks']} ranks: losses {[round(v, 6) for v in result['DP']]} (dense and FSDP alike): {verdict}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check on the local backend, on spawned Gloo processes (``--world N``), or under torchrun."""
    from fshard.testing.launch import check_main

    return check_main(check, report, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
