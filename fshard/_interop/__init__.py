"""Layer 5: conversions to and from torch's ShardedTensor and DTensor (the only room that knows them)."""
