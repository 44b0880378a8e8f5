"""fshard benchmarks, run with ``python -m fshard bench`` from the repository root.

Each benchmark is a *case*: an object with a ``group``, a ``name`` and a
``run(settings) -> list[Row]`` method (``benchmarks.common.Case``). ``run.py``
collects the cases of every module listed in ``run.CASE_MODULES``, runs them,
prints one table and writes the rows as JSON under ``bench-results/``.
"""
