"""A GPT trained with tensor and data parallelism (Megatron-style) in one ``shard_map`` per step.

The ranks form a (dp, tp) mesh. Inside the step's one ``shard_map`` each placement runs
the whole model on its batch rows (split over ``dp``) with its blocks of the weights:

- **column-parallel** ``q``, ``k``, ``v`` and ``fc``: weights split by output feature over
  ``tp`` (``Named(mesh, ("tp", None))``), so each placement computes its own attention
  heads (the view's ``-1`` takes the local head count, as Hugging Face's Llama does) and
  its columns of the MLP's hidden layer;
- **row-parallel** ``proj`` and ``out``: weights split by input feature
  (``Named(mesh, (None, "tp"))``); each placement's product is a summand, and
  ``fshard.psum(y, "tp")`` sums it over ``tp`` before the bias and the residual add;
- everything else (embeddings, norms, head) replicated.

The body calls ``gpt``, the model's forward as a pure function of its parameters: on the
local backend the bodies of a ``shard_map`` that reduces run concurrently, so they must not
share mutable state (``torch.func.functional_call`` swaps a module's parameters in place).
The loss is a pending sum over ``dp`` (``Partial(..., over=("dp",))``), equal along ``tp``
after the reductions (so ``check_vma=False``: the check cannot see that psum made it so).
``backward`` gives every weight block its gradient (psum's transpose sums over ``tp``;
replicated copies sum theirs), and SGD updates the shard tensors.

The script trains 5 steps in float64 and checks every loss and every final weight against
the unsharded ``torch.nn`` model. The program itself (``tp_specs`` and ``tp_program``) is
33 lines of code.

    python examples/gpt_tp.py                    # local backend: 1, 2 and 4 ranks (a 2 x 2 mesh on 4)
    python examples/gpt_tp.py --world 4          # 4 Gloo processes: dp=2, tp=2
    torchrun --nproc-per-node 4 examples/gpt_tp.py

It exits with status 1 if a check fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import fshard

VOCAB, SEQ, D, HEADS, BLOCKS, BATCH = 32, 8, 16, 4, 2, 4
STEPS, LR = 5, 0.1
COLUMN, ROW = ("q", "k", "v", "fc"), ("proj", "out")  # Megatron's column- and row-parallel Linears


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.proj, self.fc, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, D // HEADS).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """A small GPT: token and position embeddings, ``BLOCKS`` blocks, a final norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, D), torch.nn.Embedding(SEQ, D)
        self.blocks = torch.nn.ModuleList(Block(D) for _ in range(BLOCKS))
        self.ln, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt(p: dict[str, torch.Tensor], tokens: torch.Tensor, axis: str | None = None) -> torch.Tensor:
    """``GPT``'s forward as a function of its parameters ``p`` (by name); row-parallel outputs summed over ``axis``.

    A pure function: the bodies of a ``shard_map`` that reduces run concurrently on the local
    backend, so they must not share mutable state, such as a module whose parameters
    ``torch.func.functional_call`` swaps.
    """

    def linear(name: str, x: torch.Tensor, reduce: bool = False) -> torch.Tensor:
        y = F.linear(x, p[f"{name}.weight"])
        return (fshard.psum(y, axis) if reduce and axis else y) + p[f"{name}.bias"]

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"])

    b, t = tokens.shape
    x = F.embedding(tokens, p["wte.weight"]) + p["wpe.weight"][:t]
    for i in range(BLOCKS):
        h = norm(f"blocks.{i}.ln1", x)
        q, k, v = (linear(f"blocks.{i}.{n}", h).view(b, t, -1, D // HEADS).transpose(1, 2) for n in "qkv")
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + linear(f"blocks.{i}.proj", a, reduce=True)
        x = x + linear(f"blocks.{i}.out", F.gelu(linear(f"blocks.{i}.fc", norm(f"blocks.{i}.ln2", x))), reduce=True)
    return F.linear(norm("ln", x), p["head.weight"])


def model() -> GPT:
    """The model in float64 with weights drawn from seed 0."""
    torch.manual_seed(0)
    return GPT().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: tokens and next tokens, the same on every rank."""
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


# -- the program: what a user writes ---------------------------------------------------------------


def tp_specs(mesh: fshard.Mesh) -> Any:
    """Column-parallel ``q``, ``k``, ``v``, ``fc``; row-parallel ``proj``, ``out``; the rest replicated."""

    def spec(name: str, t: torch.Tensor) -> fshard.Named:
        layer, kind = name.split(".")[-2:]
        if layer in COLUMN:
            return fshard.Named(mesh, ("tp", None) if kind == "weight" else ("tp",))
        if layer in ROW and kind == "weight":
            return fshard.Named(mesh, (None, "tp"))
        return fshard.Named(mesh, (None,) * t.ndim)

    return spec


def tp_program(mesh: fshard.Mesh, net: GPT) -> tuple[Any, dict[str, fshard.ShardedArray]]:
    """The TP+DP training step on ``mesh`` (axes dp, tp) for ``net``'s parameters, and the sharded parameters."""
    params = fshard.shard_params(net, tp_specs(mesh))
    spec = tp_specs(mesh)
    leaves = [t.requires_grad_() for a in params.values() for t in a.addressable_data]
    opt = torch.optim.SGD(leaves, lr=LR)

    def body(tokens: torch.Tensor, targets: torch.Tensor, ws: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = gpt(ws, tokens, axis="tp")
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")[None]

    rows = fshard.Named(mesh, ("dp", None))
    loss_of = fshard.shard_map(
        body, in_specs=(rows, rows, {n: spec(n, a) for n, a in params.items()}),  # a dict of specs for the dict
        out_specs=fshard.Partial(fshard.Named(mesh, (None,)), over=("dp",)), check_vma=False,
    )  # fmt: skip

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad()
        loss = fshard.gather(loss_of(tokens, targets, params)) / targets.numel()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, params


# -- the check ------------------------------------------------------------------------------------


def dense_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of ``STEPS`` SGD steps of the unsharded model, and its final weights."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        tokens, targets = batch(s)
        opt.zero_grad()
        loss = F.cross_entropy(net(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in net.named_parameters()}


def check(ranks: Sequence[int], backend: Any = None) -> dict[str, Any]:
    """``STEPS`` TP+DP steps on ``ranks`` (tp=2 where their count is even) against the unsharded model."""
    ranks = list(ranks)
    tp = 2 if len(ranks) % 2 == 0 else 1
    mesh = fshard.Mesh((len(ranks) // tp, tp), ranks=ranks, axis_names=("dp", "tp"))
    step, params = tp_program(mesh, model())
    losses = [step(*batch(s)) for s in range(STEPS)]
    want_losses, want = dense_run()
    with torch.no_grad():
        bad = [n for n, a in params.items() if not torch.allclose(fshard.gather(a), want[n], rtol=0, atol=1e-12)]
    close = all(abs(a - b) <= 1e-12 for a, b in zip(losses, want_losses))
    return {
        "mesh": (len(ranks) // tp, tp),
        "losses": losses,
        "reference": want_losses,
        "bad": bad,
        "ok": close and not bad,
    }


def report(result: dict[str, Any]) -> str:
    """One line per check."""
    verdict = "ok" if result["ok"] else f"MISMATCH {result['bad']}"
    dp, tp = result["mesh"]
    return (
        f"dp={dp}, tp={tp}: losses {[round(x, 9) for x in result['losses']]} "
        f"(unsharded {[round(x, 9) for x in result['reference']]}): {verdict}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check on the local backend, on spawned Gloo processes (``--world N``), or under torchrun."""
    from fshard.testing.launch import check_main

    return check_main(check, report, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
