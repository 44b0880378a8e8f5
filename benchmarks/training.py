"""A training step: fshard's data-parallel and fully-sharded programs against DDP and FSDP2.

The model is a small GPT (4 blocks of causal attention and MLP, 53 parameter tensors) at
``d_model`` 128 and 512, trained on ``--world`` Gloo processes, each with its own 8
sequences of 32 tokens. Each program is written as docs/training.md and
docs/distributed.md teach it, with no hand flattening:

- **fshard DP**: the parameters ``Replicated``, the per-rank batch one array
  (``from_local_tensor``), the loss a ``shard_map`` of ``functional_call`` with a
  ``Partial`` result; ``backward``; SGD on the shard tensors.
- **fshard FSDP**: the same program with the parameters split by rows (``Chunk(0)``):
  ``shard_map`` gathers them as one tree, and the backward reduce-scatters their gradients.
- **DDP**: ``DistributedDataParallel`` of the same model; **FSDP2**: ``fully_shard`` on
  every block and the root.

Rounds are interleaved (fshard DP, DDP, fshard FSDP, FSDP2, ...); before each step every
rank waits at a barrier, a step's time is the slowest rank's, and the table shows the
median over rounds. fshard's rows also give the collectives per step and the elements
each rank sent (``backend.counters``), against the bound of the step's movements: an
all-reduce of every gradient for DP (2(n-1)/n of the parameters per rank), an all-gather
and a reduce-scatter for FSDP ((n-1)/n each), plus the loss's few elements.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard
from fshard.testing.launch import launch

from .common import Row, Settings

__all__ = ["cases"]

BLOCKS, HEADS, VOCAB, SEQ, BATCH = 4, 4, 256, 32, 8
TIMEOUT_S = 900


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """A small GPT: token and position embeddings, ``BLOCKS`` blocks, a final norm and a head."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, d), torch.nn.Embedding(SEQ, d)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(BLOCKS))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _fshard_program(d: int, style: str) -> tuple[Any, Any]:
    """The fshard step (DP: replicated parameters; FSDP: split by rows) and its backend."""
    torch.manual_seed(0)
    model = GPT(d)
    ranks = list(range(dist.get_world_size()))
    spec = fshard.Replicated(ranks) if style == "dp" else fshard.Chunk(0, ranks)
    names = [n for n, _ in model.named_parameters()]
    params = fshard.shard_params(model, lambda name, t: spec)
    leaves = [t.requires_grad_() for a in params.values() for t in a.addressable_data]
    opt = torch.optim.SGD(leaves, lr=1e-3)

    def block_loss(tokens: torch.Tensor, targets: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model, dict(zip(names, ws)), (tokens,))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")[None]

    rows = fshard.Chunk(0, ranks)
    loss_of = fshard.shard_map(
        block_loss, in_specs=(rows, rows, *[fshard.Replicated(ranks)] * len(names)),
        out_specs=fshard.Partial(fshard.Replicated(ranks)),
    )  # fmt: skip
    state = {"step": 0}

    def step() -> float:
        tokens, targets = _batch(dist.get_rank(), state["step"])
        state["step"] += 1
        xs, ys = fshard.from_local_tensor(tokens, dim=0), fshard.from_local_tensor(targets, dim=0)
        opt.zero_grad()
        loss = fshard.gather(loss_of(xs, ys, *params.values())) / ys.numel()
        loss.backward()
        opt.step()
        return float(loss.detach())

    backend = next(iter(params.values())).backend
    return step, backend


def _torch_step(model: torch.nn.Module) -> Any:
    """A plain step of ``model`` (wrapped by DDP or FSDP2) on this rank's batch."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = {"step": 0}

    def step() -> float:
        tokens, targets = _batch(dist.get_rank(), state["step"])
        state["step"] += 1
        opt.zero_grad()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _ddp_program(d: int) -> Any:
    torch.manual_seed(0)
    return _torch_step(torch.nn.parallel.DistributedDataParallel(GPT(d)))


def _fsdp2_program(d: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(d)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _torch_step(model)


def _rank_job(d: int, reps: int, peers: bool) -> dict[str, Any]:
    """On every rank: each program once untimed, then ``reps`` interleaved rounds of one step each."""
    torch.set_num_threads(1)
    dp, backend = _fshard_program(d, "dp")
    fsdp, _ = _fshard_program(d, "fsdp")
    programs: dict[str, Any] = {"fshard DP": dp, "fshard FSDP": fsdp}
    if peers:
        programs = {"fshard DP": dp, "DDP": _ddp_program(d), "fshard FSDP": fsdp, "FSDP2": _fsdp2_program(d)}
    counters = backend.counters
    moved: dict[str, tuple[int, int]] = {}
    for name, step in programs.items():
        before = (counters.collectives, counters.elements_sent)
        step()
        moved[name] = (counters.collectives - before[0], counters.elements_sent - before[1])
    samples: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(reps):
        for name, step in programs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    params = sum(p.numel() for p in GPT(d).parameters())
    return {"samples": samples, "moved": moved, "params": params}


@dataclasses.dataclass(frozen=True)
class TrainingCase:
    """One model size: every program's step time, and fshard's collectives and elements per step."""

    d: int
    group: str = "training"

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        return f"GPT d_model {self.d}"

    def run(self, settings: Settings) -> list[Row]:
        """Launches ``settings.world`` Gloo processes and times every program's step."""
        world = settings.world
        reps = max(3, settings.reps // 3) if settings.quick else settings.reps
        per_rank = launch(_rank_job, world, self.d, reps, settings.peers, timeout=TIMEOUT_S)
        names = list(per_rank[0]["samples"])
        rounds = {n: [max(r["samples"][n][k] for r in per_rank) for k in range(reps)] for n in names}
        median = {n: statistics.median(v) for n, v in rounds.items()}
        params = per_rank[0]["params"]
        bound = {"fshard DP": 2 * (world - 1) * params / world, "fshard FSDP": 2 * (world - 1) * params / world}
        peer = {"fshard DP": "DDP", "fshard FSDP": "FSDP2"}
        rows: list[Row] = []
        for n in names:
            note, sent, ratio, ratio_to = "", None, None, ""
            if n in bound:
                runs = max(r["moved"][n][0] for r in per_rank)
                elements = max(r["moved"][n][1] for r in per_rank)
                note = (
                    f"{runs} collectives per step; {elements:,} elements sent by the busiest rank, "
                    f"bound {math.ceil(bound[n]):,} + the loss's"
                )
                sent = elements * 4
                if peer[n] in median:
                    ratio, ratio_to = median[n] / median[peer[n]], peer[n]
            rows.append(
                Row(self.group, self.name, n, median[n], reps=reps, ratio=ratio, ratio_to=ratio_to, note=note,
                    samples=tuple(rounds[n]), sent_bytes=sent, min_bytes=None if n not in bound else int(bound[n]) * 4)
            )  # fmt: skip
        return rows


def cases(settings: Settings) -> list[TrainingCase]:
    """The training cases: d_model 128, and 512 unless ``--quick``."""
    return [TrainingCase(128)] + ([] if settings.quick else [TrainingCase(512)])
