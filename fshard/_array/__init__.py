"""Layer 3: ``ShardedArray``, the value users hold."""
