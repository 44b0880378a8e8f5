"""fshard benchmarks, run with ``python -m fshard bench`` from the repository root.

Each benchmark is a *case*: an object with a ``group``, a ``name`` and a
``run(settings) -> list[Row]`` method (``benchmarks.common.Case``). ``run.py``
collects the cases of every module listed in ``run.CASE_MODULES`` (planner,
local backend, torch_dist), runs them under one progress bar, prints one table per
group and writes the rows as JSON, the table as text and a plot of time against size
under ``bench-results/`` (``report.py``). The torch_dist cases (``dist.py``) run
together in one launch of N Gloo processes (``dist_rank.py``, ``dist_build.py``).
"""
