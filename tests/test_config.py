"""Settings: booleans are parsed strictly (in code and in the environment), timeouts are validated."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import fshard
from fshard._config import parse_bool_env


@pytest.fixture(autouse=True)
def _restore_settings():
    old = fshard.config()
    yield
    fshard.config(check_collectives=old.check_collectives, check_timeout=old.check_timeout)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" On ", True),
        ("0", False), ("false", False), ("False", False), ("NO", False), ("off", False), ("OFF", False),
        ("", False), ("  ", False), (None, False),
    ],
)  # fmt: skip
def test_environment_booleans_accept_the_usual_spellings_in_any_case(value, expected):
    assert parse_bool_env("FSHARD_CHECK", value) is expected


@pytest.mark.parametrize("value", ["2", "maybe", "of", "nope", "t", "-1", "0.0"])
def test_other_environment_values_are_refused_naming_them(value):
    with pytest.raises(ValueError, match=re.escape(f"FSHARD_CHECK={value!r} is not a boolean: use one of 1/true/yes")):
        parse_bool_env("FSHARD_CHECK", value)


def _import_with(value: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FSHARD_CHECK=value)
    code = "import fshard; print(fshard.config().check_collectives)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_environment_variable_is_read_at_import():
    assert _import_with("off").stdout.strip() == "False"  # "off" turned check mode on before
    bad = _import_with("sometimes")
    assert bad.returncode != 0
    assert "ValueError: FSHARD_CHECK='sometimes' is not a boolean" in bad.stderr


@pytest.mark.parametrize("value", ["false", "0", 1, 0, None, 1.0])
def test_check_collectives_takes_only_a_bool(value):
    with pytest.raises(TypeError, match=re.escape(f"check_collectives={value!r} is a {type(value).__name__}")):
        fshard.config(check_collectives=value)
    assert fshard.config().check_collectives is False


def test_check_collectives_takes_true_and_false():
    fshard.config(check_collectives=True)
    assert fshard.config().check_collectives is True
    fshard.config(check_collectives=False)
    assert fshard.config().check_collectives is False


def test_check_timeout_defaults_to_a_minute_and_takes_positive_seconds():
    assert fshard._config.Config().check_timeout == 60.0
    fshard.config(check_timeout=5)
    assert fshard.config().check_timeout == 5.0
    assert type(fshard.config().check_timeout) is float


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "check_timeout=0: give a positive, finite number of seconds"),
        (-1.5, ValueError, "check_timeout=-1.5: give a positive"),
        (float("nan"), ValueError, "check_timeout=nan: give a positive"),
        (float("inf"), ValueError, "check_timeout=inf: give a positive, finite"),
        ("60", TypeError, "check_timeout='60' is a str: give a number of seconds"),
        (True, TypeError, "check_timeout=True is a bool"),
        # torch waits in whole milliseconds: 0.4 ms read as no timeout at all (a hang instead of the error)
        (0.0004, ValueError, "check_timeout=0.0004: give from 0.001 s (torch waits in whole milliseconds"),
        # past a timedelta: every collective raised Python's OverflowError
        (1e15, ValueError, "check_timeout=1000000000000000.0: give from 0.001 s"),
        (10**400, ValueError, "check_timeout=1000000000000000000000000000000000000000: give a positive, finite"),
    ],
    ids=["zero", "negative", "nan", "inf", "string", "bool", "under-a-millisecond", "past-a-timedelta", "huge-int"],
)
def test_bad_timeouts_are_refused(value, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fshard.config(check_timeout=value)
    assert fshard.config().check_timeout == 60.0
    with pytest.raises(error, match=re.escape(message.replace("check_timeout", "timeout"))):
        fshard.config(timeout=value)
    assert fshard.config().timeout is None


def test_the_bounds_of_a_timeout_are_taken():
    old = fshard.config(timeout=0.001)
    try:
        assert fshard.config(timeout=1e12).timeout == 0.001  # config returns the settings before
        assert fshard.config().timeout == 1e12
    finally:
        fshard.config(timeout=old.timeout)


def test_unknown_settings_are_refused():
    with pytest.raises(TypeError, match=r"Unknown fshard settings \['check_timout'\]"):
        fshard.config(check_timout=1.0)
