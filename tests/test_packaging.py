"""The package metadata lists every package, so a wheel (not only an editable install) holds all the code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _packages_on_disk() -> set[str]:
    found = {
        "fshard." + ".".join(p.parent.relative_to(ROOT / "fshard").parts)
        for p in (ROOT / "fshard").rglob("__init__.py")
    }
    found = {name.rstrip(".") for name in found}
    found |= {
        "fshard.backends." + ".".join(p.parent.relative_to(ROOT / "backends").parts)
        for p in (ROOT / "backends").rglob("__init__.py")
    }
    return {name.rstrip(".") for name in found}


def test_every_package_on_disk_is_listed_in_pyproject() -> None:
    listed = set(_config()["tool"]["setuptools"]["packages"])
    assert _packages_on_disk() == listed


def test_listed_packages_exist_and_import() -> None:
    import importlib

    for name in _config()["tool"]["setuptools"]["packages"]:
        assert importlib.import_module(name).__name__ == name
