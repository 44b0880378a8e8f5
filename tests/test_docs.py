"""The documentation runs: code blocks of docs/*.md and README.md, and every docstring example.

- Each Markdown file's ```python blocks run in order in one namespace (later blocks
  use earlier names), in a temporary working directory. A failure names the file
  and the block's line; traceback lines are lines of the Markdown file.
- Each module of ``fshard`` and ``fshard.backends`` runs its doctests.
- docs/api.md has an entry for every public name, with the code's signature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import importlib
import inspect
import pkgutil
import re
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fshard

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
PACKAGES = ("fshard", "fshard.backends")
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Modules whose examples show the multi-process API: their doctests run inside a
# one-rank Gloo process group that the test creates and destroys, as torchrun would.
NEEDS_PROCESS_GROUP = {"fshard.backends.torch_dist"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the first code line
    lang: str
    code: str


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with their language and first line."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    k = 0
    while k < len(lines):
        opening = _FENCE.match(lines[k])
        if opening is None:
            k += 1
            continue
        indent, ticks = len(opening["indent"]), opening["ticks"]
        lang = opening["info"].split()[0].lower() if opening["info"] else ""
        body, k = [], k + 1
        while k < len(lines):
            closing = _FENCE.match(lines[k])
            if closing is not None and closing["ticks"].startswith(ticks) and not closing["info"]:
                break
            body.append(lines[k][indent:] if lines[k][:indent].strip() == "" else lines[k])
            k += 1
        blocks.append(Block(path, k - len(body) + 1, lang, "\n".join(body) + "\n"))
        k += 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [b for b in code_blocks(path) if b.lang in ("python", "py")]


def _doc_files_with_code() -> list[Path]:
    return [p for p in DOC_FILES if p.exists() and python_blocks(p)]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Runs each test in a temporary directory, seeded, and restores fshard's settings."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    settings = dataclasses.asdict(fshard.config())
    yield
    fshard.config(**settings)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the examples left a torch.distributed process group initialised; destroy it at the end")


@pytest.mark.parametrize("path", _doc_files_with_code(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_python_blocks_run(path: Path) -> None:
    namespace: dict[str, Any] = {"__name__": f"docs.{path.stem}"}
    name = str(path.relative_to(ROOT))
    for block in python_blocks(path):
        # Pad with blank lines so that traceback line numbers are lines of the Markdown file.
        source = "\n" * (block.line - 1) + block.code
        try:
            exec(compile(source, str(path), "exec"), namespace)
        except Exception as exc:
            trace = "".join(traceback.format_exception(exc))
        else:
            continue
        pytest.fail(f"{name}: the python block at line {block.line} failed:\n{trace}", pytrace=False)


def _module_names() -> list[str]:
    names = set()
    for package in PACKAGES:
        module = importlib.import_module(package)
        names.add(package)
        names.update(m.name for m in pkgutil.walk_packages(module.__path__, package + "."))
    return sorted(names)


@pytest.mark.parametrize("module_name", _module_names())
def test_module_doctests(module_name: str) -> None:
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder().find(module, module_name)
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report: list[str] = []
    with _process_group(module_name in NEEDS_PROCESS_GROUP):
        for test in sorted(tests, key=lambda t: t.name):
            runner.run(test, out=report.append)
    if runner.failures:
        head = f"{runner.failures} of {runner.tries} doctest examples failed in {module_name}:\n"
        pytest.fail(head + "".join(report), pytrace=False)


@contextlib.contextmanager
def _process_group(wanted: bool) -> Iterator[None]:
    """A one-rank Gloo group on an in-memory store: the single-process stand-in for torchrun."""
    if not wanted:
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --- docs/api.md is complete and true to the code ------------------------------------

_ENTRY = re.compile(r"^#{2,4} `(?P<name>fshard(?:\.\w+)+)(?P<sig>\(.*\))?`\s*$", re.MULTILINE)


def _api_entries() -> dict[str, str | None]:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return {m["name"]: m["sig"] for m in _ENTRY.finditer(text)}


def _public_names() -> list[str]:
    names = [f"fshard.{n}" for n in fshard.__all__]
    try:
        strategies = importlib.import_module("fshard.testing.strategies")
    except ImportError:
        return names
    return names + [f"fshard.testing.strategies.{n}" for n in getattr(strategies, "__all__", ())]


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _plain_signature(obj: Any) -> str:
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_api_reference_documents_every_public_name() -> None:
    entries = _api_entries()
    missing = [n for n in _public_names() if n not in entries]
    assert not missing, f"docs/api.md has no entry (a '### `name(...)`' heading) for: {missing}"


@pytest.mark.parametrize("name", sorted(_api_entries()))
def test_api_reference_entry_matches_code(name: str) -> None:
    try:
        obj = _resolve(name)
    except (ImportError, AttributeError):
        pytest.fail(f"docs/api.md documents {name}, which does not exist", pytrace=False)
    documented = _api_entries()[name]
    if documented is not None:
        actual = _plain_signature(obj)
        assert documented == actual, f"docs/api.md gives {name}{documented}; the code has {name}{actual}"


# --- docs/migration.md maps every ShardedTensor API --------------------------------------

SHARDED_TENSOR_APIS = [
    "ShardMetadata",
    "ChunkShardingSpec",
    "EnumerableShardingSpec",
    "sharded_tensor.empty",
    "sharded_tensor.ones",
    "sharded_tensor.zeros",
    "sharded_tensor.full",
    "sharded_tensor.rand",
    "sharded_tensor.randn",
    "torch.zeros_like",
    "torch.ones_like",
    "torch.empty_like",
    "torch.full_like",
    "torch.rand_like",
    "torch.randn_like",
    "_shard_tensor",
    "shard_parameter",
    ".gather(",
    ".reshard(",
    ".local_shards()",
    ".local_tensor()",
    "init_from_local_shards",
    "_init_from_local_shards_and_global_metadata",
    "_init_from_local_tensor",
    ".metadata()",
    ".remote_shards()",
    "state_dict_hook",
    "pre_load_state_dict_hook",
    "load_with_process_group",
    "custom_sharded_op_impl",
    "_reshard_output",
    "_collect_local_shard",
]


def test_migration_guide_maps_every_sharded_tensor_api() -> None:
    text = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    missing = [api for api in SHARDED_TENSOR_APIS if api not in text]
    assert not missing, f"docs/migration.md does not map: {missing}"
