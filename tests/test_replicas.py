"""Replicas that must agree, on the local backend: digests, ``check_replicas``, and check mode in gather and save."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fshard
from fshard._base.digest import digest
from fshard._exec import replicas as _replicas
from fshard.backends.local import LOCAL

RANKS = [0, 1, 2, 3]


@pytest.fixture
def check_mode():
    old = fshard.config(check_collectives=True)
    yield
    fshard.config(check_collectives=old.check_collectives)


def _drifted(spec, shape, value_of):
    """An array of ``spec`` whose shard ``i`` holds ``value_of(i, meta)``: copies that disagree when it says so."""
    layout = spec.layout(shape) if not isinstance(spec, fshard.Layout) else spec
    shards = [fshard.Shard(m, value_of(i, m)) for i, m in enumerate(layout.shards)]
    return fshard.from_local_shards_and_layout(shards, layout)


def _nan(payload: int) -> torch.Tensor:
    return torch.tensor([0x7FC00000 | payload], dtype=torch.int32).view(torch.float32)


# -- the digest --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bytes", "device"])
def test_digest_reads_bits_not_values(kind):
    """-0.0 == 0.0 and every NaN compares unequal, but a copy holds the bits: the digest tells them apart."""
    zero, negative_zero = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert torch.equal(zero, negative_zero)
    assert digest(zero, kind) != digest(negative_zero, kind)
    assert digest(_nan(1), kind) != digest(_nan(2), kind)
    assert digest(_nan(1), kind) == digest(_nan(1).clone(), kind)


@pytest.mark.parametrize("kind", ["bytes", "device"])
def test_digest_names_dtype_and_shape_and_ignores_strides(kind):
    t = torch.arange(12, dtype=torch.int32)
    assert digest(t, kind) != digest(t.view(torch.float32), kind)  # same bytes, other dtype
    assert digest(t, kind) != digest(t.reshape(3, 4), kind)  # same bytes, other shape
    m = torch.arange(12.0).reshape(3, 4)
    assert digest(m.t(), kind) == digest(m.t().contiguous(), kind)  # a view reads as its values
    odd = torch.arange(11, dtype=torch.uint8)
    assert digest(odd[1:9], kind) == digest(odd[1:9].clone(), kind)  # unaligned bytes, a partial word
    assert digest(odd[1:9], kind) != digest(odd[2:10], kind)


def test_digest_device_kind_sees_every_word_and_its_position():
    x = torch.arange(1000, dtype=torch.float32)
    seen = {digest(x, "device")}
    for i in (0, 1, 499, 999):
        y = x.clone()
        y.view(torch.int32)[i] ^= 1  # one bit of one word
        seen.add(digest(y, "device"))
    swapped = x.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    seen.add(digest(swapped, "device"))
    assert len(seen) == 6
    big = torch.full((3,), 0xFFFFFFFF - 5, dtype=torch.int64).view(torch.int32)  # words at and above the prime
    assert digest(big, "device") != digest(big.flip(0), "device")


def test_digest_under_torch_func_reads_the_wrapped_values():
    x = torch.arange(4.0)
    inside: list[bytes] = []

    def f(t):
        inside.append(digest(t))
        return (t * t).sum()

    torch.func.grad(f)(x)
    torch.func.vmap(f)(x.reshape(2, 2))
    assert inside == [digest(x), digest(x.reshape(2, 2))]


# -- check_replicas on the local backend --------------------------------------------------------


def test_check_replicas_passes_when_copies_agree():
    x = torch.randn(6, 4)
    tree = {
        "replicated": fshard.shard(x, fshard.Replicated(RANKS)),
        "mesh": fshard.shard(x, fshard.Named(fshard.Mesh((2, 2)), ("x", None))),  # copies over y
        "chunk": fshard.shard(x, fshard.Chunk(0, RANKS)),  # no copies
        "empty": fshard.shard(torch.zeros(0, 4), fshard.Replicated(RANKS)),
        "step": 3,
        "plain": torch.ones(2),
    }
    assert fshard.check_replicas(tree) is None


def test_check_replicas_names_path_box_and_ranks_of_drifted_copies():
    # Copies over mesh axis y: the box of rows 0:3 is on ranks 0 and 1, rows 3:6 on ranks 2 and 3.
    spec = fshard.Named(fshard.Mesh((2, 2)), ("x", None))
    drifted = _drifted(spec, (6, 4), lambda i, m: torch.full(m.sizes, 1.0 if m.placement.rank == 3 else 0.0))
    good = fshard.shard(torch.zeros(6, 4), spec)
    with pytest.raises(fshard.ReplicaMismatchError) as info:
        fshard.check_replicas({"params": [good, drifted]})
    msg = str(info.value)
    assert msg.startswith("check_replicas(): the copies of the ShardedArray at ['params'][1] hold different data. ")
    assert "Box [offsets (3, 0), sizes (3, 4)] has 2 values among its 2 copies: ranks [2] hold digest " in msg
    assert re.search(r"ranks \[2\] hold digest [0-9a-f]{8}, ranks \[3\] hold digest [0-9a-f]{8}\.", msg)
    assert "fshard.from_local_tensor(t, dim=0)" in msg
    assert "['params'][0]" not in msg


def test_check_replicas_groups_ranks_by_digest_and_counts_every_drifted_leaf():
    lay = fshard.Replicated(RANKS).layout((4,))
    drifted = _drifted(lay, (4,), lambda i, m: torch.full((4,), float(m.placement.rank % 2)))
    with pytest.raises(fshard.ReplicaMismatchError) as info:
        fshard.check_replicas({"a": drifted, "b": drifted, "c": fshard.shard(torch.ones(4), lay)})
    msg = str(info.value)
    assert "has 2 values among its 4 copies: ranks [0, 2] hold digest " in msg
    assert ", ranks [1, 3] hold digest " in msg
    assert "In all, 2 boxes of 2 arrays differ: the ShardedArray at ['a'], the ShardedArray at ['b']." in msg


def test_check_replicas_tells_negative_zero_and_nan_payloads_apart():
    lay = fshard.Replicated([0, 1]).layout((2,))
    signs = _drifted(lay, (2,), lambda i, m: torch.tensor([-0.0 if i else 0.0, 1.0]))
    assert fshard.equal(signs, signs)  # equal as values ...
    with pytest.raises(fshard.ReplicaMismatchError, match=re.escape("ranks [0] hold digest")):
        fshard.check_replicas(signs)  # ... not as bits
    nans = _drifted(fshard.Replicated([0, 1]).layout((1,)), (1,), lambda i, m: _nan(i + 1))
    with pytest.raises(fshard.ReplicaMismatchError, match=re.escape("the ShardedArray at the root")):
        fshard.check_replicas(nans)


def test_check_replicas_leaves_the_summands_of_a_pending_sum_alone():
    summands = fshard.shard_map(lambda t: t, fshard.Chunk(0, RANKS), fshard.Partial(fshard.Replicated(RANKS)))
    partial = summands(torch.arange(4.0).reshape(4, 1))
    assert partial.layout.partial == "sum"
    assert len({digest(t) for t in partial.addressable_data}) == 4
    assert fshard.check_replicas(partial) is None


def test_check_replicas_on_the_local_backend_exchanges_nothing(monkeypatch):
    def refuse(self, obj):
        raise AssertionError("the local backend exchanged")

    monkeypatch.setattr(type(LOCAL), "exchange", refuse)
    drifted = _drifted(fshard.Replicated([0, 1]).layout((2,)), (2,), lambda i, m: torch.full((2,), float(i)))
    fshard.check_replicas(fshard.shard(torch.ones(2), fshard.Replicated([0, 1])))
    with pytest.raises(fshard.ReplicaMismatchError):
        fshard.check_replicas(drifted)


def test_replica_mismatch_error_is_an_fshard_runtime_error_that_travels():
    from fshard.backends.torch_dist._wire import decode, encode

    assert issubclass(fshard.ReplicaMismatchError, fshard.FShardError)
    assert issubclass(fshard.ReplicaMismatchError, RuntimeError)
    back = decode(encode(fshard.ReplicaMismatchError("copies differ")), "a test")
    assert type(back) is fshard.ReplicaMismatchError
    assert str(back) == "copies differ"


# -- gather and save in check mode ---------------------------------------------------------------


def _two_copies() -> fshard.ShardedArray:
    lay = fshard.Replicated([0, 1]).layout((3,))
    return _drifted(lay, (3,), lambda i, m: torch.full((3,), float(i)))


def test_gather_in_check_mode_refuses_drifted_copies(check_mode):
    with pytest.raises(fshard.ReplicaMismatchError) as info:
        fshard.gather(_two_copies())
    msg = str(info.value)
    assert msg.startswith("gather(): the copies of the array passed to gather() hold different data. ")
    assert re.search(r"ranks \[0\] hold digest [0-9a-f]{8}, ranks \[1\] hold digest [0-9a-f]{8}", msg)
    good = fshard.shard(torch.arange(3.0), fshard.Replicated([0, 1]))
    assert fshard.gather(good).tolist() == [0.0, 1.0, 2.0]


def test_save_in_check_mode_refuses_drifted_copies_and_writes_nothing(check_mode, tmp_path: Path):
    good = fshard.shard(torch.arange(3.0), fshard.Replicated([0, 1]))
    with pytest.raises(fshard.ReplicaMismatchError) as info:
        fshard.save(tmp_path / "ckpt", {"good": good, "model": {"w": _two_copies()}})
    assert str(info.value).startswith(
        "fshard.save (nothing was written): the copies of the ShardedArray at ['model']['w'] hold different data."
    )
    assert not (tmp_path / "ckpt").exists() or list((tmp_path / "ckpt").iterdir()) == []
    fshard.save(tmp_path / "ok", {"good": good})
    assert (tmp_path / "ok" / "index.json").is_file()


def test_outside_check_mode_shard_gather_and_save_compute_no_digest(monkeypatch, tmp_path: Path):
    def refuse(*args, **kwargs):
        raise AssertionError("a digest outside check mode")

    monkeypatch.setattr(_replicas, "digest", refuse)
    assert not fshard.config().check_collectives
    drifted = _two_copies()
    assert fshard.gather(drifted).tolist() == [0.0, 0.0, 0.0]  # one copy, read silently
    fshard.save(tmp_path / "ckpt", {"w": drifted})
    fshard.shard(torch.ones(4), fshard.Chunk(0, RANKS))


def test_shard_in_check_mode_on_the_local_backend_compares_nothing(check_mode, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a digest of a tensor that one process passes once")

    monkeypatch.setattr(_replicas, "digest", refuse)
    x = fshard.shard(torch.arange(4.0), fshard.Chunk(0, RANKS))
    assert fshard.gather(x).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_check_replicas_leaves_meta_copies_out():
    meta = fshard.shard(torch.empty(3, device="meta"), fshard.Replicated(["rank:0/meta", "rank:1/meta"]))
    lay = fshard.Replicated(["rank:0/cpu", "rank:1/meta", "rank:2/cpu"]).layout((3,))
    mixed = _drifted(lay, (3,), lambda i, m: torch.ones(3, device=torch.device(m.placement.device)))
    assert fshard.check_replicas([meta, mixed]) is None
    drifted = _drifted(lay, (3,), lambda i, m: torch.full((3,), float(i), device=torch.device(m.placement.device)))
    with pytest.raises(fshard.ReplicaMismatchError, match=re.escape("has 2 values among its 2 copies")):
        fshard.check_replicas(drifted)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")


@pytest.mark.cuda
@needs_cuda
def test_device_digest_of_cuda_tensors_reads_them_on_the_gpu_alike():
    for t in (torch.randn(1 << 16), torch.tensor([0.0, -0.0]), torch.arange(11, dtype=torch.uint8)[1:9], _nan(3)):
        assert digest(t.cuda()) == digest(t, "device")
    lay = fshard.Replicated(["rank:0/cuda:0", "rank:1/cpu"]).layout((4,))
    same = _drifted(lay, (4,), lambda i, m: torch.arange(4.0, device=torch.device(m.placement.device)))
    assert fshard.check_replicas(same) is None
    signs = _drifted(lay, (4,), lambda i, m: torch.tensor([-0.0 if i else 0.0, 1, 2, 3], device=m.placement.device))
    with pytest.raises(fshard.ReplicaMismatchError, match=re.escape("ranks [0] hold digest")):
        fshard.check_replicas(signs)
