"""Testing helpers for code that uses fshard: hypothesis strategies in ``fshard.testing.strategies``."""
