"""``shard`` of a pytree of tensors on 4 Gloo processes.

With ``src=k`` the whole tree is sent in one fused movement per dtype (after the one
exchange that tells every rank the tree's structure), at the sum of the leaves' minimum
elements; with ``src=None`` nothing is sent. Every leaf equals ``shard`` of that leaf alone.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import fshard
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]


def _counted(fn):
    c = TorchDistBackend().counters
    runs, sent = c.collectives, c.elements_sent
    out = fn()
    return out, c.collectives - runs, c.elements_sent - sent


def _tree():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 5, generator=g),
        "b": torch.randn(5, generator=g),
        "e": torch.empty(0, 3),
        "s": torch.tensor(2.5),
        "r": torch.randn(3, generator=g),
        "h": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "c": torch.randn(4, 6, generator=g),
    }


SPECS = {
    "w": fshard.Chunk(0, R),
    "b": fshard.Chunk(0, R),
    "e": fshard.Chunk(0, R),
    "s": fshard.Replicated(R),
    "r": fshard.Replicated([1, 2]),  # other ranks than the rest
    "h": fshard.Chunk(0, [1, 2]),
    "c": fshard.Chunk(1, R),  # boxes that are no ranges: a movement of its own
}


def _same(a, b) -> bool:
    return a.layout == b.layout and all(torch.equal(x, y) for x, y in zip(a.addressable_data, b.addressable_data))


def _shard_from(src: int | None) -> tuple[list[bool], int, int, int, int]:
    rank = TorchDistBackend().rank
    tree = _tree()
    given = tree if src is None or rank == src else None  # off src, the tree is not read
    out, runs, sent = _counted(lambda: fshard.shard(given, SPECS, src=src))
    alone, runs_alone, sent_alone = _counted(
        lambda: {k: fshard.shard(t if src is None or rank == src else None, SPECS[k], src=src) for k, t in tree.items()}
    )
    same = [_same(out[k], alone[k]) and torch.equal(fshard.gather(out[k]), tree[k]) for k in tree]
    return same, runs, sent, runs_alone, sent_alone


def test_a_tree_from_one_rank_is_sent_in_one_movement_per_dtype(dist_pool):
    for same, runs, sent, runs_alone, sent_alone in dist_pool.run(_shard_from, 0, timeout=60):
        assert all(same)
        assert sent == sent_alone  # each rank sends what the leaves' plans send: the minimum
        # One exchange of the tree's structure, float32 ranges (w, b, e, s, r), float64 (h), and c alone.
        assert runs == 4
        assert runs_alone == 7 + 6  # an exchange per leaf, and a movement for each leaf but the empty one
    assert sum(r[2] for r in dist_pool.run(_shard_from, 0, timeout=60)) > 0


def test_a_tree_on_every_rank_sends_nothing(dist_pool):
    for same, runs, sent, _, sent_alone in dist_pool.run(_shard_from, None, timeout=60):
        assert all(same)
        assert (runs, sent, sent_alone) == (0, 0, 0)


def _bad_leaf() -> tuple[str, str]:
    tree = {"a": torch.ones(4), "step": 3} if TorchDistBackend().rank == 2 else None
    try:
        fshard.shard(tree, fshard.Chunk(0, R), src=2)
    except TypeError as exc:
        return type(exc).__name__, str(exc)
    return "returned", ""


def test_a_bad_leaf_on_the_source_rank_raises_on_every_rank(dist_pool):
    for kind, message in dist_pool.run(_bad_leaf, timeout=60):
        assert kind == "TypeError"
        assert "the leaf at ('step',) is of type int" in message
        assert "on rank 2" in message


def _spec_off_the_source(case: str) -> str:
    """Rank 1 passes a spec unlike the others' (one that fits no tensor of the source, or a tree of other keys)."""
    rank = TorchDistBackend().rank
    tree = {"a": torch.ones(4, 2), "b": torch.ones(3)} if rank == 0 else None
    spec: Any = fshard.Chunk(0, R)
    if rank == 1:
        spec = fshard.Chunk(5, R) if case == "bad dim" else {"a": fshard.Chunk(0, R), "c": fshard.Chunk(0, R)}
    try:
        fshard.shard(tree, spec, src=0)
    except (fshard.SpecError, ValueError) as exc:
        return str(exc)
    return "returned"


@pytest.mark.parametrize("case", ["bad dim", "other keys"])
def test_a_spec_unlike_the_others_off_the_source_rank_raises_on_every_rank_at_once(dist_pool, case):
    for rank, message in enumerate(dist_pool.run(_spec_off_the_source, case, timeout=30)):
        assert "passed another spec than ranks" in message, (rank, message)
        assert "give every rank the same spec" in message


def _gradients() -> tuple[list[float] | None, list[float] | None]:
    rank = TorchDistBackend().rank
    grads = []
    for as_tree in (True, False):
        x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2).requires_grad_()
        y = torch.arange(3.0, dtype=torch.float64).requires_grad_()
        given = (x, y) if rank == 0 else (None, None)
        specs = (fshard.Chunk(0, R), fshard.Replicated([1, 3]))
        if as_tree:
            a, b = fshard.shard(given if rank == 0 else None, specs, src=0)
        else:
            a, b = (fshard.shard(t, s, src=0) for t, s in zip(given, specs))
        ((fshard.gather(a) ** 2).sum() + fshard.gather(b).sin().sum()).backward()
        grads.append([*x.grad.flatten().tolist(), *y.grad.tolist()] if rank == 0 else None)
    return grads[0], grads[1]


def test_gradients_of_a_tree_sent_from_one_rank_are_those_of_its_leaves_sent_one_by_one(dist_pool):
    tree, alone = dist_pool.run(_gradients, timeout=60)[0]
    assert tree == alone
    assert tree is not None
    assert len(tree) == 11


def _check_mode() -> tuple[bool, tuple[str, str, list[str]] | None]:
    from _pool import outcome

    rank = TorchDistBackend().rank
    old = fshard.config(check_collectives=True)
    try:
        sent = fshard.shard(_tree() if rank == 1 else None, SPECS, src=1)  # checked, and it agrees
        ok = all(torch.equal(fshard.gather(sent[k]), t) for k, t in _tree().items())
    finally:
        fshard.config(check_collectives=old.check_collectives)
    differs = {"a": torch.ones(2), "b": torch.full((3,), float(rank == 3))}  # rank 3's "b" differs
    return ok, outcome(lambda: fshard.shard(differs, fshard.Replicated(R)))


def test_check_mode_compares_a_tree_on_every_rank_leaf_by_leaf(dist_pool):
    for ok, (kind, message, _) in dist_pool.run(_check_mode, timeout=60):
        assert ok
        assert kind == "CollectiveMismatchError"
        assert "the tensor at ('b',) of shard()'s tree (torch.float32, shape (3,))" in message
        assert "('a',)" not in message


def _check_mode_structures(case: str) -> tuple[str, str, list[str]] | None:
    from _pool import outcome

    rank = TorchDistBackend().rank
    t = torch.arange(4.0)
    if case == "other keys":  # rank 0's key is another: each rank would get its own tree
        tree: Any = {"a": t} if rank == 0 else {"b": t}
    elif case == "same":  # one tree whose node shows its metadata by address (another on each rank)
        tree = {"a": collections.defaultdict(lambda: 0, w=t)}
    else:  # rank 0 passes two leaves, the others one
        tree = [t, t] if rank == 0 else [t]
    old = fshard.config(check_collectives=True)
    try:
        return outcome(lambda: fshard.shard(tree, fshard.Chunk(0, R)))
    finally:
        fshard.config(check_collectives=old.check_collectives)


@pytest.mark.parametrize("case", ["other keys", "other counts", "same"])
def test_check_mode_compares_the_structure_of_a_tree_on_every_rank(dist_pool, case):
    results = dist_pool.run(_check_mode_structures, case, timeout=60)
    if case == "same":
        assert results == [None] * 4
        return
    for rank, result in enumerate(results):
        assert result is not None
        kind, message, _ = result
        assert kind == "CollectiveMismatchError"
        if case == "other keys":
            assert "shard()'s tree differs between ranks in its structure: ranks [0] passed digest" in message
            assert f"(this rank's: leaves at [({'a' if rank == 0 else 'b'!r},)])" in message
        else:
            counts = "ranks [1, 2, 3] passed 1 tensor, ranks [0] passed 2 tensors"
            assert f"shard()'s tree differs between ranks: {counts}" in message
            assert f"(this rank passed {2 if rank == 0 else 1})" in message
            assert "to shard one rank's tree, pass src=k" in message
