"""Exchanges and check mode on 4 Gloo processes: nothing from the store or a peer is unpickled,
an interrupt on one rank is named on the others, threads on two groups keep their own checks,
and a dead peer's transport error settles at once."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from _pool import outcome

import fshard
from fshard.backends.torch_dist import TorchDistBackend, _check, _exchange
from fshard.testing.launch import launch

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
X = torch.arange(96.0).reshape(8, 12)


def _outcome(fn, *, check=True, timeout=60.0):
    """(type name, message) of what ``fn()`` raised, interrupts included, or None (``_pool.outcome``)."""
    got = outcome(fn, check=check, timeout=timeout, catch=BaseException)
    return None if got is None else got[:2]


class _Evil:
    """A pickle that creates ``marker`` when loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


_ATTACKER = """
import datetime, sys
import torch.distributed as dist
port, key, probe, payload = int(sys.argv[1]), sys.argv[2], sys.argv[3], bytes.fromhex(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20))
prefix = "default_pg/0//"  # where the default group's store keys live; the probe proves it
assert store.check([prefix + probe]), "the probe key is not where the attacker looks"
store.set(prefix + key, payload)
"""


def _store_port() -> int:
    store = _check._store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store.port


def _attacked_check(marker: str):
    """Rank 3 does not call gather: an outside process writes a malicious pickle under its check key."""
    group = dist.new_group(R)  # a fresh channel: the ranks part ways on it for good
    a = fshard.shard(X, fshard.Chunk(0, R), backend=TorchDistBackend(group))
    if dist.get_rank() == 3:
        channel = _check._channel(group, tuple(R))
        key = f"fshard/check/{channel.name}/{channel.seq}/3"
        _check._store().set("fshard-test/probe", b"1")
        payload = pickle.dumps(("gather", _Evil(marker))).hex()
        port = str(_store_port())
        subprocess.run([sys.executable, "-c", _ATTACKER, port, key, "fshard-test/probe", payload], check=True)
        return None
    return _outcome(lambda: fshard.gather(a), timeout=30.0)


def test_a_pickle_written_to_the_store_is_refused_not_run(dist_pool, tmp_path):
    marker = tmp_path / "ran"
    got = dist_pool.run(_attacked_check, str(marker), timeout=90)
    assert not marker.exists()
    assert got[3] is None
    for name, msg in got[:3]:
        assert name == "CollectiveMismatchError"
        assert msg.startswith("Refused metadata from the rendezvous store (key 'fshard/check/")
        assert "rank 3's check entry): UnicodeDecodeError" in msg


class Pair(NamedTuple):
    total: torch.Tensor
    doubled: torch.Tensor


def _no_pickle_loads(path: str):
    """Check mode and exchanges of every kind, with pickle's loaders replaced by ones that raise."""

    def refuse(*args, **kwargs):
        raise AssertionError("pickle loader called")

    import torch._dynamo  # torch loads it at a dispatch mode's first call; its import subclasses Unpickler

    saved = pickle.loads, pickle.load, pickle.Unpickler
    pickle.loads = pickle.load = pickle.Unpickler = refuse
    old = fshard.config(check_collectives=True, check_timeout=30.0)
    try:
        a = fshard.shard(X, fshard.Chunk(0, [0, 1, 2]))  # rank 3 holds nothing: map_local exchanges outcomes
        b = fshard.map_local(lambda t: (t * 2).to(torch.float16), a)
        c = fshard.from_local_tensor(torch.full((2, 3), float(dist.get_rank())), dim=0)
        d = fshard.shard(X if dist.get_rank() == 2 else None, fshard.Chunk(1, R), src=2)
        r = dist.get_rank()
        e = fshard.from_local_shards(
            [fshard.Shard(fshard.ShardMeta((2 * r, 0), (2, 12), r), X[2 * r : 2 * r + 2])], X.shape
        )
        pair = fshard.map_local(lambda t: Pair(t.sum(1, keepdim=True), t * 2), a)  # a named tuple's structure
        sums = fshard.shard_map(
            lambda t: {"s": t.sum(1, keepdim=True)}, in_specs=(fshard.Chunk(0, R),), out_specs={"s": fshard.Chunk(0, R)}
        )(X)
        fshard.save(path, {"b": b, "x": X})
        loaded = fshard.load(
            path, like={"b": fshard.zeros(fshard.Chunk(1, R), 8, 12, dtype=torch.float16), "x": torch.zeros(8, 12)}
        )
        return (
            fshard.gather(b).sum().item(),
            b.dtype,
            fshard.gather(c)[:, 0].tolist(),
            fshard.equal(d, fshard.shard(X, fshard.Chunk(1, R))),
            fshard.equal(e, fshard.shard(X, fshard.Chunk(0, R))),
            type(pair).__name__,
            fshard.gather(pair.doubled).sum().item(),
            fshard.gather(sums["s"]).ravel().tolist() == X.sum(1).tolist(),
            fshard.gather(loaded["b"]).tolist() == (X * 2).tolist(),
            torch.equal(loaded["x"], X),
        )
    finally:
        fshard.config(check_collectives=old.check_collectives, check_timeout=old.check_timeout)
        pickle.loads, pickle.load, pickle.Unpickler = saved


def test_check_mode_and_exchanges_never_unpickle(dist_pool, tmp_path):
    blocks = [0.0] * 2 + [1.0] * 2 + [2.0] * 2 + [3.0] * 2
    want = ((X * 2).sum().item(), torch.float16, blocks, True, True, "Pair", (X * 2).sum().item(), True, True, True)
    assert dist_pool.run(_no_pickle_loads, str(tmp_path / "ckpt"), timeout=90) == [want] * 4


def _interrupted_map_local(check: bool, kind: str):
    """Rank 1's function raises ``kind``; rank 3 holds no block, so the ranks exchange outcomes."""
    a = fshard.shard(X, fshard.Chunk(0, [0, 1, 2]))

    def fn(t):
        if dist.get_rank() == 1:
            raise KeyboardInterrupt if kind == "KeyboardInterrupt" else SystemExit(3)
        return t + 1

    return _outcome(lambda: fshard.map_local(fn, a), check=check, timeout=30.0)


@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "SystemExit"])
@pytest.mark.parametrize("check", [False, True], ids=["check-off", "check-on"])
def test_an_interrupt_in_map_local_on_one_rank_is_named_on_the_others(dist_pool, check, kind):
    got = dist_pool.run(_interrupted_map_local, check, kind, timeout=60)
    assert got[1] == (kind, "" if kind == "KeyboardInterrupt" else "3")
    shown = kind if kind == "KeyboardInterrupt" else "SystemExit (3)"
    for r in (0, 2, 3):
        assert got[r][0] == "CollectiveMismatchError", got[r]
        assert got[r][1].startswith(f"Rank 1's function raised {shown}, which stops that rank"), got[r]


def _threads_on_two_groups():
    """Two threads, each on its own group, run check-mode reshards at the same time."""
    groups = [dist.new_group(R), dist.new_group(R)]
    results, barrier = [None, None], threading.Barrier(2)

    def work(k):
        try:
            backend = TorchDistBackend(groups[k])
            barrier.wait()
            a = fshard.shard(X + k, fshard.Chunk(k, R), backend=backend)
            for _ in range(10):
                a = fshard.reshard(a, fshard.Chunk(1 - k, R[::-1]))
                a = fshard.reshard(a, fshard.Chunk(k, R))
            results[k] = fshard.gather(a).sum().item()
        except Exception as exc:
            results[k] = f"{type(exc).__name__}: {exc}"

    old = fshard.config(check_collectives=True, check_timeout=20.0)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        fshard.config(check_collectives=old.check_collectives, check_timeout=old.check_timeout)
    return results


def test_check_mode_in_two_threads_on_two_groups(dist_pool):
    want = [X.sum().item(), (X + 1).sum().item()]
    assert dist_pool.run(_threads_on_two_groups, timeout=90) == [want] * 4


def _peer_dies_in_an_exchange():
    """The last rank takes the whole group down in the middle of an exchange, as a killed peer does."""
    last = dist.get_world_size() - 1
    if dist.get_rank() == last:

        def die(*args):
            dist.destroy_process_group()  # every connection of this rank closes
            raise SystemExit  # and this rank posts nothing more

        _exchange._all_gather_bytes = die
        TorchDistBackend.settle = lambda *args, **kwargs: None  # a dead rank settles nothing
        return _outcome(lambda: fshard.from_local_tensor(torch.ones(2), dim=0), timeout=20.0)
    start = time.monotonic()
    got = _outcome(lambda: fshard.from_local_tensor(torch.ones(2), dim=0), timeout=20.0)  # exchanges its shapes
    return got[0], got[1][:200], time.monotonic() - start


def test_a_transport_error_settles_at_once_in_check_mode():
    got = launch(_peer_dies_in_an_exchange, 3, timeout=120)
    assert got[2] == ("SystemExit", "")
    for name, msg, seconds in got[:2]:
        assert name == "RuntimeError", msg
        # Closed or reset: Gloo's words depend on how the dead rank's connections end (its group is freed at its exit).
        assert "Connection closed by peer" in msg or "Connection reset by peer" in msg, msg
        assert seconds < 10.0, f"settled after {seconds:.1f} s; check_timeout is 20 s"


def _skipped_backward():
    """Rank 1 skips the backward pass that the others run, and calls equal instead."""
    group = dist.new_group(R)  # a fresh channel: the ranks part ways on it for good
    backend = TorchDistBackend(group)
    x = fshard.shard(X.clone().requires_grad_(), fshard.Chunk(0, R), backend=backend)

    def step():
        y = fshard.reshard(x, fshard.Chunk(1, R))
        loss = fshard.gather(y).sum()
        if dist.get_rank() == 1:
            fshard.equal(y, y)
        else:
            loss.backward()

    return _outcome(step, timeout=20.0)


def test_a_skipped_backward_is_named_as_a_backward_pass(dist_pool):
    got = dist_pool.run(_skipped_backward, timeout=60)
    for name, msg in got:
        assert name == "CollectiveMismatchError", msg
        assert "ranks [0, 2, 3] called a backward pass's exchange() (loss.backward() or torch.autograd.grad)" in msg
        assert "ranks [1] called equal(" in msg


def _rank_3_without_check_mode():
    """Rank 3 runs shard(src=None), which sends nothing, with check mode off; the others with it on."""
    group = dist.new_group(R)  # a fresh channel, on which rank 3 never posts
    backend = TorchDistBackend(group)
    return _outcome(lambda: fshard.shard(X, fshard.Chunk(0, R), backend=backend), check=dist.get_rank() != 3, timeout=3)


def test_a_rank_without_check_mode_is_named_as_such(dist_pool):
    got = dist_pool.run(_rank_3_without_check_mode, timeout=60)
    assert got[3] is None
    for name, msg in got[:3]:
        assert name == "CollectiveMismatchError", msg
        assert msg.startswith("Check mode: ranks [3] of process group [0, 1, 2, 3] did not reach shard(")
        assert "within 3 s (config(check_timeout=...)): ranks [3] never posted a check on this process group: " in msg
        assert "check mode is off there (call fshard.config(check_collectives=True) on every rank)" in msg
