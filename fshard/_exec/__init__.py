"""Layer 4: running plans. Autograd, gathered values, and keeping ranks in step (check mode, agreement).

The package's global mutable state lives here.
"""
