"""``__all__`` of the public modules lists exactly what they export, sorted and once each.

``fshard/__init__.py`` is a facade: every public name comes from a private module
through ``from fshard._x import Name as Name``. The checks below read both the
module's attributes and the facade's source, so a name added to one place and
forgotten in the other fails here.
"""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import pytest

import fshard
import fshard.testing.strategies


def _public_attributes(module: types.ModuleType) -> set[str]:
    """Public (no leading underscore) attributes of ``module`` that are not modules."""
    return {n for n in dir(module) if not n.startswith("_") and not inspect.ismodule(getattr(module, n))}


def _reexports(module: types.ModuleType) -> set[str]:
    """Names bound by ``from ... import X as X`` (or plain ``import X as X``) in ``module``'s source."""
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ImportFrom, ast.Import)):
            names |= {a.asname for a in node.names if a.asname is not None and a.asname == a.name.split(".")[-1]}
    return names


def _check_all_is_well_formed(module: types.ModuleType) -> None:
    names = list(module.__all__)
    assert names == sorted(names), f"{module.__name__}.__all__ is not sorted"
    assert len(names) == len(set(names)), f"{module.__name__}.__all__ has duplicates"
    missing = [n for n in names if not hasattr(module, n)]
    assert missing == [], f"{module.__name__}.__all__ names attributes that do not exist"


def test_fshard_all_is_sorted_unique_and_exists():
    _check_all_is_well_formed(fshard)


def test_fshard_all_lists_every_public_attribute():
    assert _public_attributes(fshard) - set(fshard.__all__) == set()


def test_fshard_all_equals_the_facade_reexports():
    assert _reexports(fshard) == set(fshard.__all__)


def test_fshard_exports_come_from_private_modules():
    for name in fshard.__all__:
        value = getattr(fshard, name)
        origin = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", "")
        if origin == "fshard":  # a class that names itself by its public path (the errors)
            origin = "fshard." + Path(inspect.getfile(value)).stem
        assert origin.startswith("fshard."), (name, origin)
        if not inspect.ismodule(value):
            assert origin.split(".")[1].startswith("_"), (name, origin)


@pytest.mark.parametrize(
    "name", ["FShardError", "LayoutError", "SpecError", "CollectiveMismatchError", "CheckpointError"]
)
def test_errors_print_and_pickle_as_their_public_names(name):
    import pickle
    import traceback

    cls = getattr(fshard, name)
    assert f"{cls.__module__}.{cls.__qualname__}" == f"fshard.{name}"
    err = pickle.loads(pickle.dumps(cls("bad value")))
    assert type(err) is cls
    assert err.args == ("bad value",)
    assert traceback.format_exception_only(err) == [f"fshard.{name}: bad value\n"]


@pytest.mark.parametrize("name", ["Layout", "ShardMeta", "Placement", "Chunk", "shard", "gather", "LayoutError"])
def test_core_names_are_exported(name):
    assert name in fshard.__all__


def test_strategies_all_is_sorted_unique_and_exists():
    _check_all_is_well_formed(fshard.testing.strategies)


def test_strategies_all_lists_every_function_defined_there():
    module = fshard.testing.strategies
    defined = {
        n
        for n in _public_attributes(module)
        if getattr(getattr(module, n), "__module__", None) == module.__name__ and callable(getattr(module, n))
    }
    assert defined == set(module.__all__)
