"""Layer 1: where data lives. Placements, layouts, specs and every fact about one layout (numpy only)."""
