"""A new default process group after ``destroy_process_group``: nothing cached for the old one serves it.

Targets resolved for arrays of the old group (by ``shard_map`` and by a tree's ``reshard``)
were checked against the old group's ranks; the backend of the new group differs from the
old, so the same layouts are checked again against the new group.
"""

from __future__ import annotations

import copy
import datetime
import pickle

import torch
import torch.distributed as dist

import fshard
from fshard.testing.launch import launch


def _reinit() -> list[str]:
    rank = dist.get_rank()
    two = [0, 1]
    f = fshard.shard_map(lambda x: x * 2, in_specs=(fshard.Chunk(0, two),), out_specs=fshard.Chunk(0, two))
    x = fshard.shard(torch.arange(4.0), fshard.Replicated([0]))  # the same layout in both groups
    first = fshard.gather(f(x)).tolist()
    fshard.reshard({"a": x}, fshard.Chunk(0, two))  # the tree's targets cached too
    old = x.backend
    dist.destroy_process_group()
    if rank == 1:
        return [str(first)]
    wait = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=wait)
    new = fshard.backends.default_backend()
    y = fshard.shard(torch.arange(4.0), fshard.Replicated([0]))
    out = [str(first), str(new is not old and new != old and y.backend is new)]
    for name, call in (
        ("shard_map", lambda: f(y)),
        ("reshard", lambda: fshard.reshard({"a": y}, fshard.Chunk(0, two))),
    ):
        try:
            call()
            out.append(f"{name}: no error")
        except fshard.SpecError as exc:
            out.append(f"{name}: SpecError {exc}")
    return out


def test_a_new_default_group_gets_a_new_backend_and_its_layouts_checked_again():
    zero, one = launch(_reinit, 2, timeout=90)
    assert one == ["[0.0, 2.0, 4.0, 6.0]"]
    assert zero[:2] == ["[0.0, 2.0, 4.0, 6.0]", "True"]
    for line, name in zip(zero[2:], ("shard_map", "reshard")):
        assert line.startswith(f"{name}: SpecError Global rank 1 does not exist"), line  # not in the new group


def _copies() -> list[bool]:
    backend = fshard.backends.default_backend()
    a = fshard.shard(torch.arange(4.0), fshard.Chunk(0, [0]))
    b = copy.deepcopy(a)
    return [
        pickle.loads(pickle.dumps(backend)) == backend,
        b.backend == a.backend and torch.equal(b.local_tensor(), a.local_tensor()),
    ]


def test_a_backend_and_its_arrays_pickle_and_copy_within_their_default_group():
    assert launch(_copies, 1, timeout=60) == [[True, True]]


def _pending_across_groups() -> list[int]:
    """A check left in flight when its default group is destroyed is dropped, not settled by the next group."""
    from fshard.backends.torch_dist import _later

    rank = dist.get_rank()
    fshard.from_local_tensor(torch.zeros(2 + rank, 3), dim=0, even=True)  # the ranks differ: a pending refusal
    left = [_later.pending(None)]
    dist.destroy_process_group()
    if rank == 1:
        return left
    wait = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=wait)
    a = fshard.from_local_tensor(torch.ones(2, 3), dim=0, even=True)  # the new group's own check
    left.append(len(_later._PENDING))  # only the new group's: the old one's is gone
    left.append(int(fshard.gather(a).sum()))  # ended by this collective, without the old group's refusal
    left.append(len(_later._PENDING))
    return left


def test_checks_in_flight_go_with_their_default_group():
    zero, one = launch(_pending_across_groups, 2, timeout=90)
    assert one == [1]
    assert zero == [1, 1, 6, 0]


def _destroyed_subgroup() -> list[str]:
    group = dist.new_group([0, 1])
    x = fshard.from_local_tensor(torch.ones(2), dim=0, group=group)
    before = fshard.gather(x).tolist()
    dist.destroy_process_group(group)
    del group  # torch let go of it; the array's backend holds it weakly
    shown = repr(x.backend)  # a backend whose group is gone still says what it is
    try:
        fshard.gather(x)
        return [str(before), shown, "no error"]
    except fshard.SpecError as exc:
        return [str(before), shown, f"SpecError {exc}"]


def test_an_array_of_a_destroyed_group_refuses_to_move():
    for before, shown, got in launch(_destroyed_subgroup, 2, timeout=90):
        assert before == "[1.0, 1.0, 1.0, 1.0]"
        assert shown == "TorchDistBackend(destroyed group)"
        assert got.startswith("SpecError This array's process group was destroyed"), got
