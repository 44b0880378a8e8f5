"""Layer 5: the public functions, one module per family (move, map, shard, creation, trees, modules)."""
