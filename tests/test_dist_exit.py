"""A program that ends with ``destroy_process_group`` exits cleanly, whatever fshard values it still holds.

torch frees a process group with its last reference. One that outlives
``destroy_process_group`` is freed at the interpreter's teardown instead, where a Gloo
thread that lets go of a finished collective's tensors (the program's own last
``all_reduce``, say) aborts the process: "terminate called without an active exception",
exit status -6. So fshard holds no group into the teardown: a backend refers to its groups
weakly (a module-level array keeps none alive), as does the table of groups' facts, and
fshard's other tables (the groups ``psum`` made, caches keyed on a group) let go of theirs at
exit.

Each program runs in fresh processes, as a user's script does. The abort comes in some runs
only, so the program also checks, at exit after fshard's own exit handlers, that the
destroyed group is gone: that fails on every run where something still holds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from fshard.testing.launch import free_port

WORLD = 2
RUNS = 2
TIMEOUT = 120

# A user's script: arrays kept at module level, fshard's collectives (a movement, a shard_map's posted check, a
# psum's own group), then the program's own all_reduce as its last collective, and destroy_process_group.
PROGRAM = textwrap.dedent(
    """
    import atexit, gc, os, weakref

    def freed():  # at exit, after fshard's own exit handlers (registered later, run earlier)
        gc.collect()
        if world() is not None or sub() is not None:
            print("a destroyed group is still alive at exit", flush=True)
            os._exit(3)

    atexit.register(freed)
    import torch, torch.distributed as dist
    import fshard

    dist.init_process_group("gloo")
    R = list(range(dist.get_world_size()))
    x = fshard.shard(torch.arange(12.0).reshape(6, 2), fshard.Chunk(0, R))
    y = fshard.gather(fshard.reshard(x, fshard.Chunk(1, R)))
    mesh = fshard.Mesh((len(R),), axis_names=("i",))
    total = fshard.shard_map(
        lambda b: fshard.psum(b.sum()[None], "i"),
        in_specs=(fshard.Named(mesh, ("i", None)),),
        out_specs=fshard.Named(mesh, (None,)),
        check_vma=False,  # psum made the sums equal along "i"
    )(x)
    assert fshard.gather(total).item() == 66.0
    group = dist.new_group(R)  # an array of a group given explicitly, kept at module level too
    z = fshard.from_local_tensor(torch.ones(2), dim=0, group=group)
    assert fshard.gather(z).tolist() == [1.0] * (2 * len(R))
    sub = weakref.ref(group)
    del group
    dist.all_reduce(torch.ones(4))  # a tensor that only the collective's work holds by its end
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    """
)


def _run_once() -> list[tuple[int, str]]:
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PROGRAM], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    out: list[tuple[int, str]] = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=TIMEOUT)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            p.kill()
    return out


def test_a_program_that_destroys_its_group_exits_cleanly_with_arrays_still_held():
    for _ in range(RUNS):
        for rank, (code, text) in enumerate(_run_once()):
            assert code == 0, f"rank {rank} exited with {code}:\n{text[-2000:]}"
            assert "terminate called" not in text, text[-2000:]
