"""Shared test configuration: hypothesis profiles and the multi-process pool fixture."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# -- multi-process tests -----------------------------------------------------------------

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from _pool import Pool  # noqa: E402


@pytest.fixture(scope="session")
def dist_pool():
    """A pool of 4 Gloo worker processes for the multi-process property tests of the session."""
    pool = Pool(world=4)
    pool.start()
    yield pool
    pool.close()
