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
    """``fshard``'s packages and those of every folder mapped into it (``backends/``, ``benchmarks/``)."""
    folders = {"fshard": "fshard", **_config()["tool"]["setuptools"]["package-dir"]}
    found = {
        f"{package}." + ".".join(p.parent.relative_to(ROOT / folder).parts)
        for package, folder in folders.items()
        for p in (ROOT / folder).rglob("__init__.py")
    }
    return {name.rstrip(".") for name in found}


def test_backends_and_benchmarks_are_installed_inside_fshard() -> None:
    assert _config()["tool"]["setuptools"]["package-dir"] == {
        "fshard.backends": "backends",
        "fshard.benchmarks": "benchmarks",
    }


def test_license_matches_the_declared_license() -> None:
    project = _config()["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("BSD 3-Clause License\n\nCopyright (c) the fshard developers\n")
    assert "3. Neither the name of the copyright holder nor the names of its" in text


def test_classifiers_describe_the_package() -> None:
    classifiers = _config()["project"]["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # the license expression says it
    supported = {c.rsplit(" ", 1)[-1] for c in classifiers if c.startswith("Programming Language :: Python :: 3.")}
    assert min(supported, key=lambda v: tuple(map(int, v.split(".")))) == "3.10"


def test_every_package_on_disk_is_listed_in_pyproject() -> None:
    listed = set(_config()["tool"]["setuptools"]["packages"])
    assert _packages_on_disk() == listed


def test_listed_packages_exist_and_import() -> None:
    import importlib

    for name in _config()["tool"]["setuptools"]["packages"]:
        assert importlib.import_module(name).__name__ == name
