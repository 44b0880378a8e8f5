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
- **fshard FSDP (per block)**: docs/training.md's fully-sharded program by blocks: the model
  as stages (the embeddings, each block, the final norm and head), each sharded with
  ``shard_module(stage, fully_sharded(ranks))`` and applied with
  ``apply_module(..., regather=True)``: each stage's parameters are gathered for its forward,
  freed when it returns, gathered again in the backward, and their gradients reduce-scattered
  as soon as that stage's backward is done. The last stage keeps its copy (its backward comes
  next), as FSDP2 keeps its root's. Each stage's gather is started before the stage ahead of
  it runs (``fshard.prefetch``), and in the backward ``regather`` starts the previous stage's
  gather while a stage's backward runs, as FSDP2 prefetches both ways.
- **DDP**: ``DistributedDataParallel`` of the same model; **FSDP2**: ``fully_shard`` on
  every block and the root.

Rounds are interleaved (fshard DP, DDP, fshard FSDP, fshard FSDP (per block), FSDP2, ...);
before each step every rank waits at a barrier, a step's time is the slowest rank's, and the
table shows the median over rounds. fshard's rows also give the collectives per step and the
elements each rank sent (``backend.counters``), against the bound of the step's movements: an
all-reduce of every gradient for DP (2(n-1)/n of the parameters per rank), an all-gather
and a reduce-scatter for FSDP ((n-1)/n each; per block, one more all-gather in the backward),
plus the loss's few elements (and for DP the one element that the last gradient bucket
carries: the count of gradients that arrived late).

**Peak memory per rank** is measured before the timed rounds, for each program on its own:
the bytes of live tensors that torch's CPU allocator holds, from the profiler's memory events
(``torch.profiler`` with ``profile_memory=True``: every allocation and free, summed in time
order) over building the program, one step, and a second step whose highest total is the
peak. It counts everything the program holds in tensors (parameters, gradients, gathered
copies, activations, communication buffers that are torch tensors) and nothing else (the
interpreter, Gloo's own buffers). The profiler records no event for a free on a thread it
does not follow (a Gloo thread that drops a finished collective, and its buffers, after the
caller has), so allocations are matched to frees by address, and an address allocated again
while counted live counts as freed in between (one not allocated again stays counted: the
peaks are upper bounds, the peers' too). fshard's programs keep the model only as a template on the
meta device, as ``fully_shard`` keeps none of the full weights.

fshard recycles the memory of its dead outputs and buffers (an output pool, like torch's CUDA
caching allocator: ``fshard/_base/alloc.py``), and the programs share processes, so each of
fshard's programs is measured from an emptied pool (``empty_cache()``), or a block that an
earlier program left would serve it without an allocation event. Each is measured twice: with
the pool keeping nothing for reuse (a dead block is freed at the pool's next call, so the
count may hold one dead block a while: the peak of live tensors, the number compared with the
peer's) and as it runs (the pool's cached blocks counted as held). The numpy buffers of the
small rounds that carry data with their headers are not torch tensors and are not counted.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard
import fshard._base.alloc as _alloc
from fshard.backends.local import empty_cache
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
    params = fshard.shard_params(model, lambda name, t: spec)
    model.to("meta")  # a template for functional_call: the arrays hold the values
    leaves = [t.requires_grad_() for a in params.values() for t in a.addressable_data]
    opt = torch.optim.SGD(leaves, lr=1e-3)

    def block_loss(tokens: torch.Tensor, targets: torch.Tensor, ws: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = torch.func.functional_call(model, ws, (tokens,))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")[None]

    rows = fshard.Chunk(0, ranks)
    loss_of = fshard.shard_map(  # the parameters one dict, with one spec: they move (and sum) as one tree
        block_loss, in_specs=(rows, rows, fshard.Replicated(ranks)), out_specs=fshard.Partial(fshard.Replicated(ranks))
    )
    state = {"step": 0}

    def step() -> float:
        tokens, targets = _batch(dist.get_rank(), state["step"])
        state["step"] += 1
        xs, ys = fshard.from_local_tensor((tokens, targets), dim=0, even=True)  # checked at the next collective
        opt.zero_grad()
        # The backward from each rank's summand of the loss at once; data parallel's last bucket sums the loss.
        loss = fshard.backward(loss_of(xs, ys, params) / ys.numel())
        opt.step()
        return float(loss)

    backend = next(iter(params.values())).backend
    return step, backend


class _Stem(torch.nn.Module):
    """``GPT``'s token and position embeddings, as one stage."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))


class _Head(torch.nn.Module):
    """``GPT``'s final norm and head, as one stage."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln, self.head = gpt.ln, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


def _summed_loss(head: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(x).flatten(0, 1), targets.flatten(), reduction="sum")[None]


def _per_block_program(d: int) -> tuple[Any, Any]:
    """docs/training.md's fully-sharded step by blocks: a stage per ``apply_module``, ``regather=True``, prefetched."""
    torch.manual_seed(0)
    model = GPT(d)
    ranks = list(range(dist.get_world_size()))
    stages = [_Stem(model), *model.blocks, _Head(model)]
    params = [fshard.shard_module(stage, fshard.fully_sharded(ranks))[0] for stage in stages]
    model.to("meta")  # the stages are templates: the arrays hold the values
    opt = torch.optim.SGD([t.requires_grad_() for p in params for a in p.values() for t in a.addressable_data], lr=1e-3)
    everywhere = fshard.Replicated(ranks)
    summed = fshard.Partial(everywhere)
    state = {"step": 0}

    def step() -> float:
        tokens, targets = _batch(dist.get_rank(), state["step"])
        state["step"] += 1
        xs, ys = fshard.from_local_tensor((tokens, targets), dim=0, even=True)
        opt.zero_grad()
        h = xs
        for k, (stage, p) in enumerate(zip(stages[:-1], params[:-1])):
            # The next stage's gather flies while this one computes (its call takes the data).
            fshard.prefetch(params[k + 1], everywhere)
            # A block keeps its input's layout: given as the out_specs, no rank waits for the others' shapes.
            keep = {"out_specs": h.layout} if k else {}
            h, _ = fshard.apply_module(stage, p, {}, h, regather=True, **keep)
        # The last stage's backward comes right after its forward: it keeps its copy (as FSDP2's root does).
        total, _ = fshard.apply_module(stages[-1], params[-1], {}, h, ys, method=_summed_loss, out_specs=summed)
        loss = fshard.gather(total) / ys.numel()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, next(iter(params[0].values())).backend


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


def _makers(peers: bool) -> dict[str, Any]:
    """Each program's maker (a function of ``d`` that returns the step), in the order of the rounds."""
    makers: dict[str, Any] = {
        "fshard DP": lambda d: _fshard_program(d, "dp")[0],
        "DDP": _ddp_program,
        "fshard FSDP": lambda d: _fshard_program(d, "fsdp")[0],
        "fshard FSDP (per block)": lambda d: _per_block_program(d)[0],
        "FSDP2": _fsdp2_program,
    }
    return makers if peers else {n: m for n, m in makers.items() if n.startswith("fshard")}


def _peak_bytes(make: Any, d: int, *, pooled: bool = True) -> int:
    """The most bytes of live tensors (torch's CPU allocator) while the program built by ``make`` takes its second step.

    From the profiler's memory events (each allocation and free), summed in time order from
    before the program was built, so that the total counts what the program holds. fshard's
    output pool is emptied first; with ``pooled`` false it keeps no dead block for reuse, so
    the total counts live tensors (and a dead block until the pool's next call), else it
    counts the blocks the pool keeps for reuse too.
    """
    empty_cache()  # blocks an earlier program left would serve this one unseen
    gc.collect()
    limit = _alloc.POOL_LIMIT_BYTES
    _alloc.POOL_LIMIT_BYTES = limit if pooled else 0
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step = make(d)
            step()
            dist.barrier()
            with torch.profiler.record_function("fshard.bench.measured_step"):
                step()
    finally:
        _alloc.POOL_LIMIT_BYTES = limit
    del step
    empty_cache()
    window, allocations = _memory_events(prof)
    total, peak, live = 0, 0, {}
    for at, ptr, nbytes in sorted(allocations):
        # A free on another thread (Gloo's, holding a collective's last reference) leaves no
        # event: an address allocated again while counted live was freed in between.
        total -= live.pop(ptr, 0)
        if nbytes > 0:
            live[ptr] = nbytes
            total += nbytes
        if window[0] <= at <= window[1]:
            peak = max(peak, total)
    return peak


def _memory_events(prof: Any) -> tuple[tuple[int, int], list[tuple[int, int, int]]]:
    """The measured step's (start, end) and every allocation and free as (time, address, bytes) from ``prof``."""
    window, allocations = (0, -1), list[tuple[int, int, int]]()
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        fields = node.extra_fields
        if isinstance(fields, torch._C._profiler._ExtraFields_Allocation):  # pyright: ignore[reportPrivateUsage]
            allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        elif isinstance(fields, torch._C._profiler._ExtraFields_TorchOp):  # pyright: ignore[reportPrivateUsage]
            try:
                name = node.name
            except UnicodeDecodeError:  # a name the profiler kept as bytes that are not UTF-8
                continue
            if name == "fshard.bench.measured_step":
                window = (node.start_time_ns, node.end_time_ns)
    if window[1] < 0:
        raise RuntimeError("the profile holds no measured step")
    return window, allocations


def _rank_job(d: int, reps: int, peers: bool) -> dict[str, Any]:
    """On every rank: each program's peak memory, each once untimed, then ``reps`` interleaved rounds of a step."""
    torch.set_num_threads(1)
    makers = _makers(peers)
    peaks = {name: _peak_bytes(make, d, pooled=False) for name, make in makers.items()}
    held = {name: _peak_bytes(make, d) for name, make in makers.items() if name.startswith("fshard")}
    dp, backend = _fshard_program(d, "dp")
    programs: dict[str, Any] = {name: dp if name == "fshard DP" else make(d) for name, make in makers.items()}
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
    model = GPT(d)
    params = sum(p.numel() for p in model.parameters())
    kept = (model.wte, model.wpe, model.ln, model.head)  # no weights saved, or the last stage's
    kept_once = sum(p.numel() for m in kept for p in m.parameters())
    return {"samples": samples, "moved": moved, "params": params, "kept": kept_once, "peaks": peaks, "held": held}


def _timed(job: Any, d: int, settings: Settings) -> tuple[list[Any], int, dict[str, list[float]], dict[str, float]]:
    """``job`` on ``settings.world`` Gloo processes, timed.

    Returns each rank's results, the number of rounds, and per program the slowest rank's time of
    each round and their median.
    """
    reps = max(3, settings.reps // 3) if settings.quick else settings.reps
    per_rank = launch(job, settings.world, d, reps, settings.peers, timeout=TIMEOUT_S)
    names = list(per_rank[0]["samples"])
    rounds = {n: [max(r["samples"][n][k] for r in per_rank) for k in range(reps)] for n in names}
    return per_rank, reps, rounds, {n: statistics.median(v) for n, v in rounds.items()}


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
        per_rank, reps, rounds, median = _timed(_rank_job, self.d, settings)
        names = list(rounds)
        params = per_rank[0]["params"]
        once = (world - 1) * params / world  # an all-gather, or a reduce-scatter, of every parameter
        # Per block, the backward gathers the blocks again (not the embeddings, whose backward needs no
        # weights, nor the last stage, which keeps its copy).
        again = (world - 1) * (params - per_rank[0]["kept"]) / world
        bound = {"fshard DP": 2 * once, "fshard FSDP": 2 * once, "fshard FSDP (per block)": 2 * once + again}
        peer = {"fshard DP": "DDP", "fshard FSDP": "FSDP2", "fshard FSDP (per block)": "FSDP2"}
        rows: list[Row] = []
        for n in names:
            note, sent, ratio, ratio_to = "", None, None, ""
            peak = max(r["peaks"][n] for r in per_rank) / (1 << 20)
            held = max(r["held"].get(n, 0) for r in per_rank) / (1 << 20)
            if n in bound:
                runs = max(r["moved"][n][0] for r in per_rank)
                elements = max(r["moved"][n][1] for r in per_rank)
                note = (
                    f"{runs} collectives per step; {elements:,} elements sent by the busiest rank, "
                    f"bound {math.ceil(bound[n]):,} + the loss's"
                    + (
                        " (the last bucket carries it, with the late-gradient count and the leaves' uses)"
                        if n == "fshard DP"
                        else ""
                    )
                    + (" (one more all-gather of the blocks in the backward)" if "block" in n else "")
                )
                sent = elements * 4
                if peer[n] in median:
                    ratio, ratio_to = median[n] / median[peer[n]], peer[n]
                    theirs = max(r["peaks"][peer[n]] for r in per_rank) / (1 << 20)
                    note += f"; peak memory {peak / theirs:.2f}x {peer[n]}'s ({held / theirs:.2f}x with the pool's)"
            pooled = f" ({held:.1f} MiB with the output pool's cached blocks)" if n in bound else ""
            note = f"peak {peak:.1f} MiB of tensors per rank{pooled}" + (f"; {note}" if note else "")
            rows.append(
                Row(self.group, self.name, n, median[n], reps=reps, ratio=ratio, ratio_to=ratio_to, note=note,
                    samples=tuple(rounds[n]), sent_bytes=sent, min_bytes=None if n not in bound else int(bound[n]) * 4,
                    peak_mib=peak)
            )  # fmt: skip
        return rows


def cases(settings: Settings) -> list[TrainingCase | TPTrainingCase]:
    """The training cases: d_model 128, and 512 unless ``--quick``; TP+DP where the world is even."""
    sizes = [128] + ([] if settings.quick else [512])
    tp = [TPTrainingCase(d) for d in sizes] if settings.world % 2 == 0 else []
    return [*(TrainingCase(d) for d in sizes), *tp]


# -- tensor and data parallelism -------------------------------------------------------------------
#
# The model of examples/gpt_tp.py (separate q, k, v Linears, so that a split by output feature
# gives each tp rank whole heads; the views take the local head count with -1), trained on a
# (dp, tp = 2) mesh: fshard's one shard_map per step with psum over tp after each row-parallel
# Linear, against torch's parallelize_module (ColwiseParallel / RowwiseParallel) and DDP over dp.

_COLUMN, _ROW = ("q", "k", "v", "fc"), ("proj", "out")


class _TPBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.proj, self.fc, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, d // HEADS).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TPGPT(GPT):
    """``GPT`` with separate ``q``, ``k``, ``v`` Linears in its blocks (whole heads per tp rank)."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.blocks = torch.nn.ModuleList(_TPBlock(d) for _ in range(BLOCKS))


def _tp_forward(p: dict[str, torch.Tensor], tokens: torch.Tensor, d: int) -> torch.Tensor:
    """``TPGPT``'s forward as a function of its parameters, row-parallel outputs summed over ``tp``."""

    def linear(name: str, x: torch.Tensor, reduce: bool = False) -> torch.Tensor:
        y = F.linear(x, p[f"{name}.weight"])
        return (fshard.psum(y, "tp") if reduce else y) + p[f"{name}.bias"]

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"])

    b, t = tokens.shape
    x = F.embedding(tokens, p["wte.weight"]) + p["wpe.weight"][:t]
    for i in range(BLOCKS):
        h = norm(f"blocks.{i}.ln1", x)
        q, k, v = (linear(f"blocks.{i}.{n}", h).view(b, t, -1, d // HEADS).transpose(1, 2) for n in "qkv")
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + linear(f"blocks.{i}.proj", a, reduce=True)
        x = x + linear(f"blocks.{i}.out", F.gelu(linear(f"blocks.{i}.fc", norm(f"blocks.{i}.ln2", x))), reduce=True)
    return F.linear(norm("ln", x), p["head.weight"])


def _tp_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``BATCH`` sequences per dp rank, the same tensor on every rank."""
    g = torch.Generator().manual_seed(1000 * step)
    tokens = torch.randint(VOCAB, (BATCH * dp, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _tp_specs(mesh: fshard.Mesh) -> Any:
    def spec(name: str, t: torch.Tensor) -> fshard.Named:
        layer, kind = name.split(".")[-2:]
        if layer in _COLUMN:
            return fshard.Named(mesh, ("tp", None) if kind == "weight" else ("tp",))
        if layer in _ROW and kind == "weight":
            return fshard.Named(mesh, (None, "tp"))
        return fshard.Named(mesh, (None,) * t.ndim)

    return spec


def _fshard_tp_program(d: int, dp: int) -> tuple[Any, Any]:
    """The fshard TP+DP step (examples/gpt_tp.py's program) on a (dp, 2) mesh, and its backend."""
    torch.manual_seed(0)
    mesh = fshard.Mesh((dp, 2), axis_names=("dp", "tp"))
    params = fshard.shard_params(TPGPT(d), _tp_specs(mesh))
    spec = _tp_specs(mesh)
    leaves = [t.requires_grad_() for a in params.values() for t in a.addressable_data]
    opt = torch.optim.SGD(leaves, lr=1e-3)

    def body(tokens: torch.Tensor, targets: torch.Tensor, ws: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = _tp_forward(ws, tokens, d)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")[None]

    rows = fshard.Named(mesh, ("dp", None))
    loss_of = fshard.shard_map(
        body, in_specs=(rows, rows, {n: spec(n, a) for n, a in params.items()}),  # a dict of specs for the dict
        out_specs=fshard.Partial(fshard.Named(mesh, (None,)), over=("dp",)), check_vma=False,
    )  # fmt: skip
    state = {"step": 0}

    def step() -> float:
        tokens, targets = _tp_batch(state["step"], dp)
        state["step"] += 1
        opt.zero_grad()
        loss = fshard.gather(loss_of(tokens, targets, params)) / targets.numel()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, next(iter(params.values())).backend


def _torch_tp_program(d: int, dp: int) -> Any:
    """The torch TP+DP step: ``parallelize_module`` over tp on a (dp, 2) device mesh, DDP over dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform  # pyright: ignore[reportPrivateUsage]

    torch.manual_seed(0)
    model = TPGPT(d)
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    plan: dict[str, Any] = {}
    for i in range(BLOCKS):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in _COLUMN})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in _ROW})
    parallelize_module(model, mesh["tp"], plan)
    _pre_dp_module_transform(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    state = {"step": 0}
    rows = slice(mesh["dp"].get_local_rank() * BATCH, (mesh["dp"].get_local_rank() + 1) * BATCH)

    def step() -> float:
        tokens, targets = _tp_batch(state["step"], dp)
        state["step"] += 1
        opt.zero_grad()
        loss = F.cross_entropy(ddp(tokens[rows]).flatten(0, 1), targets[rows].flatten())
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _tp_rank_job(d: int, reps: int, peers: bool) -> dict[str, Any]:
    """On every rank: each TP+DP program once untimed, then ``reps`` interleaved rounds of one step each."""
    torch.set_num_threads(1)
    dp = dist.get_world_size() // 2
    ours, backend = _fshard_tp_program(d, dp)
    programs: dict[str, Any] = {"fshard TP+DP": ours}
    if peers:
        programs["TP+DDP"] = _torch_tp_program(d, dp)
    counters = backend.counters
    before = (counters.collectives, counters.elements_sent)
    losses = {name: step() for name, step in programs.items()}
    moved = (counters.collectives - before[0], counters.elements_sent - before[1])
    samples: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(reps):
        for name, step in programs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    params = sum(p.numel() for p in TPGPT(d).parameters())
    return {"samples": samples, "moved": moved, "params": params, "losses": losses}


def _tp_bound(d: int, world: int, params: int) -> float:
    """Elements each rank sends per TP+DP step at the collectives' bounds.

    Four all-reduces over tp=2 per block (two psums forward, their transposes backward) of one
    rank's activations, ``BATCH * SEQ * d`` each (an all-reduce over 2 ranks sends half, twice);
    and the all-reduce over dp of a rank's gradients, 2(dp-1)/dp of them. A tp rank holds the
    replicated parameters and half of the split ones.
    """
    dp = world // 2
    split = BLOCKS * (4 * d * d + 4 * d + 8 * d * d + 4 * d)  # q, k, v, proj, fc, out weights and split biases
    per_rank = params - split // 2
    return 4 * BLOCKS * BATCH * SEQ * d + 2 * (dp - 1) * per_rank / dp


@dataclasses.dataclass(frozen=True)
class TPTrainingCase:
    """fshard's TP+DP step against torch's ``parallelize_module`` + DDP: time, collectives, elements."""

    d: int
    group: str = "training"

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        return f"GPT d_model {self.d}, TP+DP (tp=2)"

    def run(self, settings: Settings) -> list[Row]:
        """Launches ``settings.world`` Gloo processes (a (world/2, 2) mesh) and times both programs' steps."""
        world = settings.world
        per_rank, reps, rounds, median = _timed(_tp_rank_job, self.d, settings)
        bound = _tp_bound(self.d, world, per_rank[0]["params"])
        runs = max(r["moved"][0] for r in per_rank)
        elements = max(r["moved"][1] for r in per_rank)
        note = (
            f"{runs} collectives per step; {elements:,} elements sent by the busiest rank, bound "
            f"{math.ceil(bound):,} (Megatron's: activations over tp, gradients over dp) + the loss's; "
            "the replicated parameters' gradients are also summed over their tp copies, each a part"
        )
        peer = "TP+DDP" if "TP+DDP" in median else ""
        rows = [
            Row(self.group, self.name, "fshard TP+DP", median["fshard TP+DP"], reps=reps,
                ratio=median["fshard TP+DP"] / median[peer] if peer else None, ratio_to=peer, note=note,
                samples=tuple(rounds["fshard TP+DP"]), sent_bytes=elements * 4, min_bytes=int(bound) * 4)
        ]  # fmt: skip
        if peer:
            rows.append(Row(self.group, self.name, peer, median[peer], reps=reps, samples=tuple(rounds[peer])))
        return rows
