"""Save a checkpoint mid-training on 4 ranks, resume on 2: the next steps' losses are the same.

Trains the tensor-parallel MLP of ``tp_mlp.py`` with SGD and momentum. After
``SAVE_AT`` steps on 4 ranks, ``fshard.save`` writes the training state (parameters,
momentum buffers and the step number); the 4 ranks then train ``MORE`` more steps.
``fshard.load`` reads the state back in the 2-rank layouts, and 2 ranks train the
same ``MORE`` steps. Checks:

- the loaded parameters and momentum equal the saved ones bit for bit;
- the losses of the steps after the save are the same on 2 ranks as on 4 (and as
  in the unsharded model trained for as many steps), to float64 rounding: 4 and 2
  ranks sum the partial outputs of the row-parallel layer in a different order.

    python examples/resume.py                 # local backend: 4 ranks, then 2, in this process
    python examples/resume.py --world         # 4 Gloo processes save, then 2 new ones resume
    torchrun --nproc-per-node 4 examples/resume.py --phase save --dir /tmp/ckpt
    torchrun --nproc-per-node 2 examples/resume.py --phase resume --dir /tmp/ckpt

Under torchrun each phase checks its losses against the unsharded model. The script
exits with status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tp_mlp  # next to this file: the script's folder is on sys.path

import fshard

SAVE_AT, MORE = 3, 2
LR, MOMENTUM = 0.1, 0.9


def initial_state(ranks: Sequence[int], backend: Any = None) -> dict[str, Any]:
    """Step 0: the model's parameters in the tensor-parallel layouts, zero momentum."""
    params = tp_mlp.shard_model(tp_mlp.model(), ranks, backend)
    return {"params": params, "momentum": {k: fshard.zeros_like(p) for k, p in params.items()}, "step": 0}


def train_step(state: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """One step of SGD with momentum on the batch of ``state["step"]``: the new state and the loss."""
    x, y = tp_mlp.batch(state["step"])
    grads, loss = torch.func.grad_and_value(tp_mlp.loss_fn)(state["params"], x, y)
    momentum = {k: fshard.map_local(lambda m, g: MOMENTUM * m + g, v, grads[k]) for k, v in state["momentum"].items()}
    params = {k: fshard.map_local(lambda p, m: p - LR * m, v, momentum[k]) for k, v in state["params"].items()}
    return {"params": params, "momentum": momentum, "step": state["step"] + 1}, float(loss)


def train(state: dict[str, Any], steps: int) -> tuple[dict[str, Any], list[float]]:
    """``steps`` training steps: the final state and each step's loss."""
    losses = []
    for _ in range(steps):
        state, loss = train_step(state)
        losses.append(loss)
    return state, losses


def reference_losses(steps: int) -> list[float]:
    """The losses of the unsharded model trained the same way."""
    net = tp_mlp.model()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(steps):
        x, y = tp_mlp.batch(step)
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def specs(ranks: Sequence[int]) -> dict[str, Any]:
    """What ``fshard.load`` should return: the state in the layouts for ``ranks``."""
    layout = tp_mlp.specs(ranks)
    return {"params": layout, "momentum": layout, "step": None}


def _values(tree: dict[str, fshard.ShardedArray]) -> dict[str, list[Any]]:
    """The full values as nested lists of floats (exact; picklable without shared memory)."""
    return {k: fshard.gather(v).tolist() for k, v in tree.items()}


def save_phase(path: str, ranks: Sequence[int], backend: Any = None) -> dict[str, Any]:
    """Trains ``SAVE_AT`` steps, saves, trains ``MORE`` steps; the losses and the saved values."""
    state, before = train(initial_state(ranks, backend), SAVE_AT)
    fshard.save(path, state)
    saved = {"params": _values(state["params"]), "momentum": _values(state["momentum"])}
    _, after = train(state, MORE)
    return {"ranks": len(list(ranks)), "losses": before + after, "saved": saved}


def resume_phase(path: str, ranks: Sequence[int], backend: Any = None) -> dict[str, Any]:
    """Loads the state in the layouts for ``ranks`` and trains ``MORE`` steps; the losses and the loaded values."""
    state = fshard.load(path, specs=specs(ranks), backend=backend)
    loaded = {"params": _values(state["params"]), "momentum": _values(state["momentum"])}
    layouts = {k: v.layout for k, v in state["params"].items()}
    _, after = train(state, MORE)
    return {"ranks": len(list(ranks)), "step": state["step"], "losses": after, "loaded": loaded, "layouts": layouts}


def _close(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(abs(u - v) <= 1e-9 * abs(v) + 1e-12 for u, v in zip(a, b))


def compare(saved: dict[str, Any], resumed: dict[str, Any]) -> dict[str, Any]:
    """The checks of this example, from what the save and the resume phases returned."""
    same_state = saved["saved"] == resumed["loaded"]
    reference = reference_losses(SAVE_AT + MORE)
    return {
        "saved_on": saved["ranks"],
        "resumed_on": resumed["ranks"],
        "continued": saved["losses"][SAVE_AT:],
        "resumed": resumed["losses"],
        "reference": reference[SAVE_AT:],
        "same_state": same_state,
        "ok": same_state
        and resumed["step"] == SAVE_AT
        and _close(resumed["losses"], saved["losses"][SAVE_AT:])
        and _close(resumed["losses"], reference[SAVE_AT:])
        and _close(saved["losses"], reference),
    }


def report(result: dict[str, Any]) -> str:
    """What was compared, in a few lines."""
    fmt = lambda xs: ", ".join(f"{x:.12f}" for x in xs)  # noqa: E731
    return "\n".join(
        [
            f"saved after step {SAVE_AT} on {result['saved_on']} ranks, resumed on {result['resumed_on']}",
            f"  state after loading equals the saved state: {'yes' if result['same_state'] else 'NO'}",
            f"  next losses, {result['saved_on']} ranks continuing: {fmt(result['continued'])}",
            f"  next losses, {result['resumed_on']} ranks resumed:    {fmt(result['resumed'])}",
            f"  next losses, unsharded model:    {fmt(result['reference'])}",
            f"verdict: {'ok' if result['ok'] else 'MISMATCH'}",
        ]
    )


def _save_job(path: str) -> dict[str, Any]:
    return save_phase(path, range(dist.get_world_size()))


def _resume_job(path: str) -> dict[str, Any]:
    return resume_phase(path, range(dist.get_world_size()))


def _torchrun(phase: str, path: str) -> int:
    """One phase on the processes torchrun started, checked against the unsharded model."""
    dist.init_process_group("gloo")
    try:
        job = _save_job if phase == "save" else _resume_job
        result = job(path)
    finally:
        dist.destroy_process_group()
    want = reference_losses(SAVE_AT + MORE)
    want = want if phase == "save" else want[SAVE_AT:]
    ok = _close(result["losses"], want)
    if int(os.environ["RANK"]) == 0:
        verdict = "ok" if ok else "MISMATCH"
        print(f"{phase} on {result['ranks']} ranks: losses {result['losses']}, unsharded {want}: {verdict}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Saves on 4 ranks and resumes on 2: in this process, on spawned Gloo processes, or under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", action="store_true", help="spawn 4, then 2 Gloo processes")
    parser.add_argument("--phase", choices=["save", "resume"], help="under torchrun: the phase to run")
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.dir is not None and os.path.exists(args.dir) and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir} is a file; give a directory for the checkpoint")
    if "RANK" in os.environ and not dist.is_initialized():
        if args.phase is None or args.dir is None:
            parser.error("under torchrun, pass --phase save|resume and --dir")
        return _torchrun(args.phase, args.dir)
    if args.phase is not None:
        parser.error("--phase runs one phase under torchrun; without torchrun the script runs both")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or os.path.join(tmp, "ckpt")
        if args.world:
            from fshard.testing.launch import launch

            saved, resumed = launch(_save_job, 4, path)[0], launch(_resume_job, 2, path)[0]
        else:
            saved, resumed = save_phase(path, range(4)), resume_phase(path, range(2))
        result = compare(saved, resumed)
    print(report(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
