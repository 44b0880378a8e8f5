import torch

import fshard


def test_shard_reshard_gather_round_trip():
    x = torch.arange(200.0).reshape(10, 20)
    a = fshard.shard(x, fshard.Chunk(0, [0, 1, 2, 3]))
    b = fshard.reshard(a, fshard.Named(fshard.Mesh((2, 2)), ("x", "y")))
    assert torch.equal(fshard.gather(b), x)
    assert [s.data.shape[0] for s in a.addressable_shards] == [3, 3, 3, 1]
