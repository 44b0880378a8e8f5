"""Layer 0: machinery that knows no fshard value type (boxes, caches, memory, the compile boundary)."""
