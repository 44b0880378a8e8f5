"""Test configuration shared by tests/ and property_tests/: hypothesis profiles and one
session-wide pool of Gloo worker processes for every multi-process test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

sys.path.append(str(Path(__file__).resolve().parent / "tests"))
from _pool import Pool  # noqa: E402


@pytest.fixture(scope="session")
def dist_pool():
    """A pool of 4 Gloo worker processes shared by every multi-process test of the session."""
    pool = Pool(world=4)
    pool.start()
    yield pool
    pool.close()
