"""Type checking as users and the project see it: pyright over user code, and over the package.

fshard ships ``py.typed``, so a user's type checker reads its annotations. These tests run
pyright (the ``test`` extra installs it) on a user-style file and on ``fshard/`` and
``backends/`` with the project's settings (``[tool.pyright]`` in ``pyproject.toml``, strict
on the paths it lists).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("pyright") is None, reason="pyright is not installed (the test extra)")

USER_CODE = """
import torch
import fshard

x = fshard.shard(torch.arange(8.0), fshard.Chunk(0, [0, 1]))
y = fshard.reshard(x, fshard.Replicated([0, 1]))
a: fshard.ShardedArray = x + 1
b: fshard.ShardedArray = 2 * x - y
c: fshard.ShardedArray = -x
d: fshard.ShardedArray = x.sum()
e: fshard.ShardedArray = x.sum(0, keepdim=True) / 3
f: fshard.ShardedArray = x ** 2 <= y
g: torch.Tensor = fshard.gather(a)
"""


def _user_project(folder: Path) -> Path:
    """A project beside the repository that finds fshard's source as an installed package would be found.

    (An editable install's import hook is invisible to static checkers.)
    """
    (folder / "pyrightconfig.json").write_text(json.dumps({"extraPaths": [str(ROOT)]}))
    return folder


def _pyright(*args: str, cwd: Path) -> dict[str, Any]:
    out = subprocess.run(
        ["pyright", "--outputjson", "--pythonpath", sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    try:
        return json.loads(out.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no report:\n{out.stdout}\n{out.stderr}")


def _errors(report: dict[str, Any]) -> list[str]:
    return [
        f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]


def test_operators_type_check_in_user_code(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_CODE))
    report = _pyright("user.py", cwd=_user_project(tmp_path))
    assert _errors(report) == []
    assert report["summary"]["filesAnalyzed"] == 1


def test_an_undefined_operator_is_a_type_error(tmp_path: Path) -> None:
    """The check above can fail: ``@`` is not defined on ``ShardedArray``."""
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_CODE) + "h = x @ y\n")
    errors = _errors(_pyright("user.py", cwd=_user_project(tmp_path)))
    assert len(errors) == 1
    assert 'Operator "@" not supported' in errors[0]


def test_the_package_type_checks_with_the_project_settings() -> None:
    report = _pyright(cwd=ROOT)
    assert _errors(report) == []
