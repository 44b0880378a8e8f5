"""Tensors handed to collectives that Gloo's worker threads run are watched until those threads let go.

A tensor that Python has let go of while such a thread holds it is freed on that thread,
which must take the GIL to free its Python object; at interpreter exit that stops the thread
inside a destructor and aborts the process, so the process waits at exit until no watched
tensor is held. Checked here: what counts as held, that watching keeps nothing alive, and
that every collective's tensors are let go once the group's threads are done (the exit of
whole programs is run by ``test_quickstart_runs_under_torchrun``).
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.torch_dist import _watch

R = [0, 1, 2, 3]


def test_a_view_handed_over_is_held_while_something_besides_python_holds_it():
    t = torch.zeros(4)
    before = _watch.held()
    (view,) = _watch.handed(t)
    holder = torch._C.ScriptList([view])  # a holder outside Python, as a collective's work is
    assert _watch.held() == before + 1
    del holder
    assert _watch.held() == before


def test_a_tensor_kept_elsewhere_is_not_waited_for():
    t = torch.zeros(4)
    holder = torch._C.ScriptList([t])  # kept outside Python for good (a gradient, a saved tensor)
    before = _watch.held()
    _watch.handed(t)  # only the fresh view is watched, and only Python held it
    assert _watch.held() == before
    del holder


def test_watching_keeps_nothing_alive():
    (view,) = _watch.handed(torch.zeros(4))
    gone = weakref.ref(view)
    del view
    gc.collect()
    assert gone() is None


def _after_collectives() -> int:
    """How many watched tensors are held after some movements, once the group's threads are done."""
    x = torch.arange(64.0 * 48).reshape(64, 48)
    a = fshard.shard(x, fshard.Chunk(0, R))
    b = fshard.reshard(a, fshard.Chunk(1, R))  # headers, then data, by all_to_all_single
    p = fshard.reshard(b, fshard.Partial(fshard.Replicated(R)))
    fshard.gather(fshard.reshard(p, fshard.Chunk(0, R)))
    dist.barrier()  # a barrier holds the collectives in progress when it started, too
    deadline = time.monotonic() + 10
    while _watch.held() and time.monotonic() < deadline:
        time.sleep(0.001)
    return _watch.held()


@pytest.mark.multiprocess
def test_every_collectives_tensors_are_let_go_once_the_threads_are_done(dist_pool):
    assert dist_pool.run(_after_collectives, timeout=120) == [0] * len(R)
