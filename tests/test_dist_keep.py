"""Tensors handed to collectives that Gloo's worker threads run are kept until those threads let go.

A tensor freed on such a thread must take the GIL to free its Python object, which at
interpreter exit stops the thread inside a destructor and aborts the process. Checked here:
the keeping itself, and that every collective's tensors are let go once the group's threads
are done (the exit of whole programs is run by ``test_quickstart_runs_under_torchrun``).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.torch_dist import _keep

R = [0, 1, 2, 3]


def test_a_tensor_is_kept_while_something_besides_python_holds_it():
    t = torch.zeros(4)
    held = torch._C.ScriptList([t])  # a holder outside Python, as a collective's work is
    before = _keep.kept()
    _keep.keep(t.view(torch.uint8), t)
    assert _keep.kept() == before + 1
    del held
    assert _keep.kept() == before


def _after_collectives() -> int:
    """How many collectives' tensors are kept after some movements, once the group's threads are done."""
    x = torch.arange(64.0 * 48).reshape(64, 48)
    a = fshard.shard(x, fshard.Chunk(0, R))
    b = fshard.reshard(a, fshard.Chunk(1, R))  # headers, then data, by all_to_all_single
    p = fshard.reshard(b, fshard.Partial(fshard.Replicated(R)))
    fshard.gather(fshard.reshard(p, fshard.Chunk(0, R)))
    dist.barrier()  # a barrier holds the collectives in progress when it started, too
    deadline = time.monotonic() + 10
    while _keep.kept() and time.monotonic() < deadline:
        time.sleep(0.001)
    return _keep.kept()


@pytest.mark.multiprocess
def test_every_collectives_tensors_are_let_go_once_the_threads_are_done(dist_pool):
    assert dist_pool.run(_after_collectives, timeout=120) == [0] * len(R)
