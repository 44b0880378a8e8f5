"""The error contract, fuzzed: garbage in, a typed error that names it out.

Every public callable of ``fshard.__all__`` (and the public methods that parse user
input) is called with valid arguments, one or two of them replaced by garbage: wrong
types, ints near 2**63, bools where ints go, floats, numeric strings, nested lists,
``None``, tensors of the wrong dtype, ndim, device or layout, arrays of the wrong
layout, ranks out of range. A call passes the contract when it returns, or raises

- an ``fshard.FShardError`` (``LayoutError``/``SpecError`` are the ``ValueError``\\s), or
- a ``TypeError``, ``NotImplementedError`` or ``IndexError`` raised by a ``raise``
  statement of fshard itself (DESIGN.md documents these builtins: ``TypeError`` for
  non-int shapes, ``NotImplementedError`` for a named dim, ``IndexError`` for ``size(dim)``),

and, when one argument was replaced, its message names that argument (its name, its
value or its type). Anything else is a bad outcome: ``AttributeError``, ``KeyError``,
``OverflowError``, ``RecursionError``, ``MemoryError``, a raw ``RuntimeError`` or
``ValueError``, a ``TypeError`` from Python or torch ("unsupported operand", "not
subscriptable"), and also returning for a value that must be refused (a non-bool flag, a
rank of -1). Two outcomes are not about the arguments and pass: the allocator refusing
terabytes that a valid shape asks for, and the local backend's refusal to make torch's
distributed types.

Conjugate and negative views (``z.conj()``, ``z.conj().imag``) are valid input: a separate
property test checks that their values, not their lazy bits, are what gets sharded.

Input classes that once broke the contract are listed in ``KNOWN``, each with the
fix it needed: ``test_once_failing_input`` pins one concrete input of each as a
regression test, and the fuzz draws them like any other input.

Counts (inputs tried, outcomes by entry point and type) without stopping at the
first bad outcome: ``FSHARD_FUZZ_REPORT=1 python -m pytest -q -s property_tests/test_fuzz.py``;
``FSHARD_FUZZ_EXAMPLES=n`` sets the examples per entry point (100 in CI, about 20 s here).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import dis
import functools
import itertools
import math
import os
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

import fshard
from fshard import Chunk, Explicit, Layout, Mesh, Named, Partial, Placement, Replicated, Shard, ShardMeta, Single

REPORT = bool(os.environ.get("FSHARD_FUZZ_REPORT"))
EXAMPLES = int(os.environ.get("FSHARD_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
SOURCES = tuple(str(Path(m.__file__).resolve().parent) for m in (fshard, fshard.backends))
DELIBERATE = (TypeError, NotImplementedError, IndexError)

# -- sample values ---------------------------------------------------------------------------

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    T34 = torch.arange(12.0).reshape(3, 4)
    Z34 = torch.complex(T34, -T34)
    TENSORS = (
        T34,
        torch.zeros(3, 4, dtype=torch.int64),
        torch.ones(3, 4, dtype=torch.bool),
        torch.ones(3, 4, dtype=torch.complex64),
        torch.ones(3, 4, dtype=torch.float16),
        torch.tensor(2.0),
        torch.ones(0),
        torch.ones(0, 4),
        torch.ones(4, 3).t(),
        torch.ones(1, 4).expand(3, 4),
        torch.ones(3, 4, requires_grad=True),
        torch.ones(3, 4, device="meta"),
        torch.ones(3, 4).to_sparse(),
        torch.ones(3, 4).to_sparse_csr(),
        torch.ones(1, 2, 1, 2, 1),
        torch.full((3, 4), float("nan")),
        torch.nn.Parameter(torch.ones(3, 4)),
        # Lazy views (their values are sharded), and kinds fshard refuses: quantized, nested.
        Z34.conj(),
        Z34.conj().imag,
        torch._neg_view(T34),
        Z34.conj().t(),
        torch.ones(3, 4, dtype=torch.complex64).to("meta").conj(),
        torch.quantize_per_tensor(T34, 0.5, 0, torch.quint8),
        torch.nested.nested_tensor([torch.ones(4), torch.ones(3)]),
    )
    ROWS = fshard.shard(T34, Chunk(0, [0, 1]))
    ARRAYS = (
        ROWS,
        fshard.shard(T34, Chunk(1, [0, 1, 2, 3])),
        fshard.shard(T34, Replicated([0, 1])),
        fshard.shard(torch.arange(4.0), Chunk(0, [0, 1])),
        fshard.shard(torch.tensor(1.0), Replicated([0])),
        fshard.shard(torch.ones(0, 3), Chunk(0, [0, 1])),
        fshard.shard(T34, Partial(Replicated([0, 1]))),
        fshard.shard(torch.arange(12).reshape(3, 4), Chunk(0, [0, 1])),
        fshard.shard(torch.ones(3, 4, dtype=torch.bool), Single(3)),
        fshard.shard(torch.ones(3, 4, requires_grad=True), Chunk(0, [0, 1])),
        fshard.shard(T34, Single(7)),
    )
    HALVES = Chunk(0, [0, 1]).layout((4,))
    SPECS = (
        Chunk(0, [0, 1]),
        Chunk(1, [0, 1, 2, 3]),
        Chunk(-1, [0]),
        Chunk(5, [0]),
        Replicated([0, 1]),
        Single(7),
        Single("rank:0/meta"),
        Named(Mesh((2, 2)), ("x", None)),
        Named(Mesh((2, 2)), ("x", "y")),
        Explicit([((0,), (2,), 0), ((2,), (2,), 1)]),
        Partial(Replicated([0, 1])),
        Partial(Chunk(0, [0, 1]), "max"),
        HALVES,
        ROWS.layout,
        Partial(Replicated([0, 1])).layout((3, 4)),
        Mesh((2, 2)),
        Placement(3),
        ShardMeta((0,), (4,), 0),
        Shard(ShardMeta((0,), (2,), 0), torch.zeros(2)),
    )
    FNS = (
        lambda *a: a[0] if a else None,
        lambda *a: a[0] * 2 if a else 2,
        lambda *a: 3,
        lambda *a: None,
        lambda *a: "x",
        lambda *a: a[0][:1] if a else a,
        lambda *a: a[0].sum() if a else a,
        lambda *a: [a[0], a[0]] if a else [],
        lambda *a: torch.ones(1),
        lambda *a: a[0].to(torch.int64) if a else a,
        lambda *a: a[0].to_sparse() if a else a,
        lambda *a: a[0].to("meta") if a else a,
        lambda *a: {"y": a[0]} if a else {},
    )
    OTHERS = (
        object(),
        np.int64(2),
        np.float32(1.5),
        np.array([1, 2]),
        np.bool_(True),
        torch.float32,
        torch.int64,
        torch.device("meta"),
        torch.Size([3, 4]),
        slice(0, 2),
        Ellipsis,
        b"6",
        1j,
        frozenset({1}),
        {1, 2},
        range(3),
        torch.nn.Linear(2, 2),
        fshard.backends,
        type,
    )


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors
        return torch.quantize_per_tensor(T34, 0.5, 0, torch.quint8)


def _meta_array() -> fshard.ShardedArray:
    """An array on the meta device (built per draw: it has no values to show in a repr)."""
    return fshard.shard(torch.ones(3, 4, device="meta"), Chunk(0, ["rank:0/meta", "rank:1/meta"]))


def _bad_shard_lists() -> tuple[list[Shard], ...]:
    """Shards of ``ROWS`` that no layout can take: one twice, sparse, on the meta device (not cpu)."""
    parts = list(ROWS.addressable_shards)
    return (
        [parts[0], *parts],
        [Shard(p.meta, p.data.to_sparse()) for p in parts],
        [Shard(p.meta, p.data.to("meta")) for p in parts],
    )


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    BAD_SHARDS = _bad_shard_lists()
    ON_RANK_5 = [Shard(ShardMeta(p.meta.offsets, p.meta.sizes, 5), p.data) for p in ROWS.addressable_shards]


SCHEDULE = fshard.plan(HALVES, Chunk(0, [1, 0]).layout((4,))).for_rank(0)

HUGE = (2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, -1, -2, -(2**63), -(2**63) - 1, -(2**64))
WORDS = ("", "6", "-1", "2.5", "x", "sum", "mean", "cpu", "meta", "cuda:0", "cuda:99", "rank:0/cpu", "rank:7/cpu")
WORDS += ("rank:0/meta", "worker0/cuda:1", "float32", "True", "None", "\x00", "é", "..")

# Ints stay small or far beyond memory (2**40 elements and up): no garbage shape allocates for real.
ints = st.one_of(st.integers(-3, 7), st.sampled_from(HUGE))
floats = st.sampled_from((0.0, -0.0, 0.5, 2.0, 3.7, 1e300, -1e-300, math.nan, math.inf, -math.inf))
texts = st.one_of(st.sampled_from(WORDS), st.text(max_size=4))
atoms = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    floats,
    texts,
    st.sampled_from(TENSORS),
    st.sampled_from(ARRAYS),
    st.sampled_from(SPECS),
    st.sampled_from(FNS),
    st.sampled_from(OTHERS),
)
junk = st.recursive(
    atoms,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(texts, ints), inner, max_size=3),
    ),
    max_leaves=6,
)
# Empty shapes whose other extents overflow (torch refuses to make them), and products past int64.
OVERFLOWING = ((2**40, 2**40, 0), (2**62, 4, 0), (0, 2**40, 2**40), (2**32, 2**32), (2**21, 2**21, 2**21))
int_tuples = st.one_of(st.lists(ints, max_size=4).map(tuple), st.sampled_from(OVERFLOWING))
garbage = st.one_of(junk, int_tuples, st.lists(ints, max_size=4))
rank_junk = st.one_of(garbage, st.sampled_from((True, False, 1.0, -1, 7, 2**63, "0", np.int64(1))))
shard_junk = st.one_of(garbage, st.sampled_from((*BAD_SHARDS, ON_RANK_5)))
var_junk = st.one_of(st.lists(garbage, max_size=3).map(tuple), garbage.map(lambda v: (v,)))
# Tensors and arrays first, where a tensor argument goes: the rest of garbage is refused by its type.
tensor_junk = st.one_of(st.sampled_from(TENSORS), st.sampled_from(ARRAYS), garbage)
inputs_junk = st.one_of(st.lists(tensor_junk, max_size=3).map(tuple), var_junk)

# -- the entry points ------------------------------------------------------------------------


def _not_bool(value: Any) -> bool:
    return type(value) is not bool


def _not_optional_bool(value: Any) -> bool:
    return value is not None and type(value) is not bool


def _not_optional_int(value: Any) -> bool:
    return value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)))


def _not_a_rank(value: Any) -> bool:
    """Not ``None`` and equal to no non-negative int (``torch_dist`` tests ``rank in ranks``, so 1.0 and True pass)."""
    if value is None:
        return False
    try:
        return not (value == int(value) and int(value) >= 0)
    except (TypeError, ValueError, OverflowError):
        return True


def _int_past_int64(value: Any) -> bool:
    """An int rank that no layout can hold (layouts keep ranks as int64)."""
    return isinstance(value, int) and not 0 <= value < 2**63


def _bad_shard_list(value: Any) -> bool:
    return any(value is bad for bad in BAD_SHARDS)


def _not_plain(value: Any) -> bool:
    """A tensor whose elements fshard cannot shard: quantized or nested."""
    return isinstance(value, torch.Tensor) and (value.is_quantized or value.is_nested)


def _not_optional_dtype(value: Any) -> bool:
    return value is not None and not isinstance(value, torch.dtype)


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of an entry point.

    Attributes:
        name: the parameter's name (messages about it must name it).
        valid: its valid values, or a factory of fresh ones (for values a call may change).
        kind: ``"pos"``, ``"kw"``, ``"var"`` (a tuple passed as ``*args``) or ``"kwargs"``
            (a dict passed as ``**kwargs``).
        junk: the garbage to try there; ``None``: the argument is never replaced.
        reject: garbage values that the call must refuse (a non-bool where a bool goes):
            returning for one of them breaks the contract too.
    """

    name: str
    valid: tuple[Any, ...] | Callable[[], Any]
    kind: str = "pos"
    junk: st.SearchStrategy[Any] | None = garbage
    reject: Callable[[Any], bool] | None = None

    @property
    def values(self) -> st.SearchStrategy[Any]:
        return st.builds(self.valid) if callable(self.valid) else st.sampled_from(self.valid)

    def default(self) -> Any:
        return self.valid() if callable(self.valid) else self.valid[0]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A public callable (or a lambda that calls a public method) and its arguments.

    ``expected``: part of the message of the ``FShardError`` that even valid arguments get on
    the local backend (torch's types need torch.distributed): that error names no garbage.
    """

    fn: Callable[..., Any]
    args: tuple[Arg, ...]
    expected: str = ""


def one(*values: Any) -> tuple[Any, ...]:
    return values


def kw(name: str, valid: tuple[Any, ...], reject: Callable[[Any], bool] | None = None) -> Arg:
    return Arg(name, valid, "kw", reject=reject)


def rank(name: str) -> Arg:
    """``src``/``dst``: ``None`` or a rank, and nothing else."""
    return Arg(name, (None, 0, 1), "kw", rank_junk, _not_a_rank)


def shards() -> Arg:
    """A list of ``ROWS``'s shards, and lists that no layout takes."""
    return Arg("shards", (list(ROWS.addressable_shards),), junk=shard_junk, reject=_bad_shard_list)


def flag(name: str, valid: tuple[Any, ...] = (False, True)) -> Arg:
    """A keyword that takes a real ``bool`` (or ``None`` where ``valid`` has it) and refuses anything else."""
    return Arg(name, valid, "kw", reject=_not_optional_bool if None in valid else _not_bool)


def var(name: str, valid: tuple[Any, ...]) -> Arg:
    """Positional arguments passed as ``*name``: each valid value (and each garbage value) is a tuple."""
    return Arg(name, valid, "var", var_junk)


SHAPE = var("shape", ((3, 4), ((3, 4),), ([3, 4],), (torch.Size([3, 4]),)))
DTYPE = kw("dtype", (None, torch.float32, torch.float64), _not_optional_dtype)
DEVICE = kw("device", (None, "cpu", "meta"))
GRAD = flag("requires_grad")
BACKEND = kw("backend", (None,))
ARRAY = Arg("array", one(*ARRAYS[:4]))
CREATION_SPEC = Arg("spec", one(Chunk(0, [0, 1]), Replicated([0, 1]), Named(Mesh((2, 2)), ("x", "y"))))


def _paths(base: Path) -> st.SearchStrategy[Any]:
    """Garbage paths: all inside ``base`` (so nothing is written elsewhere), or not paths at all."""
    names = st.sampled_from(("missing", "file", "empty", "badjson", "6", "file/sub", "a" * 300))
    return st.one_of(names.map(lambda n: str(base / n)), names.map(lambda n: base / n), junk.filter(_not_a_path))


def _not_a_path(value: Any) -> bool:
    return not isinstance(value, (str, bytes, os.PathLike))


def _saved_tree() -> dict[str, Any]:
    return {"w": ROWS, "b": torch.ones(2), "step": 3}


def _checkpoint(base: Path) -> Path:
    path = base / "ckpt"
    if not (path / "index.json").exists():
        fshard.save(path, _saved_tree())
        (base / "file").write_text("not a checkpoint")
        (base / "empty").mkdir()
        (base / "badjson").mkdir()
        (base / "badjson" / "index.json").write_text("{[")
    return path


# -- modules, optimizers and bodies ------------------------------------------------------------


class _AnyInput(torch.nn.Module):
    """A Linear(4, 3) and a call counter whose forward takes any arguments.

    Garbage arguments then reach what ``apply_module`` does with them (arrays say where to
    run, tensors are replicated, other values pass through), not a ``TypeError`` of the
    module's own code: a float 2-D tensor of 4 columns goes through the Linear, anything
    else gets the sum of its weight. In training mode it counts its calls in a buffer, in place.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.training:
            self.calls.add_(1)
        x = next((a for a in (*args, *kwargs.values()) if _fits_linear(a)), None)
        return self.lin.weight.sum()[None] if x is None else self.lin(x)


def _fits_linear(a: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.dtype == torch.float32
        and a.layout == torch.strided
        and a.device.type == "cpu"
        and a.ndim == 2
        and a.shape[1] == 4
        and a.shape[0] > 0
        and not a.is_quantized
        and not a.is_nested
    )


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    MODEL = _AnyInput()
    MODEL_PARAMS, MODEL_BUFFERS = fshard.shard_module(MODEL, fshard.fully_sharded([0, 1]))
    BATCH = fshard.shard(torch.arange(24.0).reshape(6, 4), Chunk(0, [0, 1]))
    OPT_PARAMS = {"w": fshard.shard(torch.ones(4, 2), Chunk(0, [0, 1])), "b": torch.zeros(3)}
    for _t in optree.tree_leaves(OPT_PARAMS):
        _t.requires_grad_()  # parameters that train: a state for each (a frozen one has none)
MLP = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
TP_MESH = Mesh((1, 2), axis_names=("dp", "tp"))
RULES = (
    fshard.fully_sharded([0, 1]),
    fshard.replicated([0, 1]),
    {"weight": Chunk(0, [0, 1]), "*": Replicated([0, 1])},
)


def _optimizer() -> torch.optim.Optimizer:
    """A fresh AdamW over the shard tensors of ``OPT_PARAMS`` (stepping it at lr 0 leaves them as they are)."""
    return torch.optim.AdamW(optree.tree_leaves(OPT_PARAMS), lr=0.1)


def _saved_state() -> dict[str, Any]:
    return fshard.optimizer_state(_optimizer(), OPT_PARAMS)


def _state_junk() -> st.SearchStrategy[Any]:
    """Garbage for ``load_optimizer_state``'s ``state``: anything, or a saved state with one part replaced."""

    def edit(part: str, value: Any) -> dict[str, Any]:
        state = _saved_state()
        if part == "state.exp_avg":
            state["state"]["exp_avg"] = value
        elif part == "state.step.w":
            state["state"]["step"]["w"] = value
        elif part == "param_groups.0":
            state["param_groups"][0] = value
        elif part == "param_groups.0.arrays":
            state["param_groups"][0]["arrays"] = value
        else:
            state[part] = value
        return state

    parts = st.sampled_from(
        ("state", "param_groups", "state.exp_avg", "state.step.w", "param_groups.0", "param_groups.0.arrays")
    )
    return st.one_of(garbage, st.builds(edit, parts, garbage))


class _Block:
    """Stands for the body's own block where ``psum``/``pmean`` take ``x`` (garbage replaces it)."""

    def __repr__(self) -> str:
        return "<the body's block>"


BLOCK = _Block()


def _reduce(fn: Callable[..., Any], x: Any, axis: Any) -> Any:
    """``fn(x, axis)`` (``fshard.psum``/``pmean``) inside a ``shard_map`` body over two placements (rows of 4x2)."""
    body = lambda b: fn(b if x is BLOCK else x, axis)  # noqa: E731
    run = fshard.shard_map(body, in_specs=Chunk(0, [0, 1]), out_specs=Replicated([0, 1]), check_vma=False)
    return run(torch.arange(8.0).reshape(4, 2))


def _under_no_sync() -> None:
    """Enters and leaves ``fshard.no_sync()``."""
    with fshard.no_sync():
        return None


_fresh = itertools.count()

PREFETCHED = {
    "w": fshard.shard(torch.ones(4, 2), Chunk(0, [0, 1])),
    "b": fshard.shard(torch.zeros(4), Chunk(0, [0, 1])),
}


def _prefetch(arrays: Any, spec: Any, **kwargs: Any) -> Any:
    """``fshard.prefetch``, whose movement is then cancelled (no call takes it here)."""
    started = fshard.prefetch(arrays, spec, **kwargs)
    started.cancel()
    return started


def _pending() -> Any:
    """A movement in flight (``Prefetch``'s argument), from a prefetch of its own arrays."""
    arrays = fshard.shard(torch.ones(4, 2), Chunk(0, [0, 1]))
    return fshard.prefetch(arrays, Replicated([0, 1]))._pending  # what fshard.prefetch wraps


ON_DIST = "needs an array on the torch_dist backend"


def _loss_array() -> fshard.ShardedArray:
    """A fresh loss: a pending sum over two ranks of one element, from a tensor that requires grad."""
    w = torch.ones(4, requires_grad=True)
    return fshard.shard_map(
        lambda b: b.sum()[None], in_specs=(Chunk(0, [0, 1]),), out_specs=Partial(Replicated([0, 1]))
    )(w)


def entries(base: Path) -> dict[str, Entry]:
    """Every fuzzed callable by name; ``base`` is a temporary directory for checkpoints."""
    ckpt = _checkpoint(base)
    path = _paths(base)
    new_dir = lambda: str(base / f"save-{next(_fresh)}")  # noqa: E731
    seed = kw("seed", (None, 0, 7), _not_optional_int)
    creation = (CREATION_SPEC, SHAPE, DTYPE, DEVICE, GRAD, BACKEND)
    like = (ARRAY, DTYPE, GRAD)
    return {
        "Placement": Entry(
            Placement, (Arg("rank", one(0, 3), reject=_int_past_int64), Arg("device", one("cpu", "meta")))
        ),
        "Placement.parse": Entry(Placement.parse, (Arg("text", one("rank:0/cpu", "rank:3")),)),
        "ShardMeta": Entry(
            ShardMeta,
            (Arg("offsets", one((0, 0), [1, 2])), Arg("sizes", one((2, 4), [0, 1])), Arg("placement", one(0))),
        ),
        "Layout": Entry(
            Layout,
            (
                Arg("shape", one((4,), [4])),
                Arg("shards", one(HALVES.shards, [((0,), (2,), 0), ((2,), (2,), "rank:1/cpu")])),
                Arg("partial", one(None, "sum")),
            ),
        ),
        "Layout.from_dict": Entry(Layout.from_dict, (Arg("data", one(HALVES.to_dict()), junk=_dict_junk()),)),
        "Layout.from_arrays": Entry(
            Layout.from_arrays,
            (
                Arg("shape", one((4,), [4])),
                Arg("offsets", one([[0], [2]], np.array([[0], [2]]))),
                Arg("sizes", one([[2], [2]], np.array([[2], [2]]))),
                Arg("ranks", one([0, 1], np.array([3, 2]))),
                Arg("devices", one("cpu", ["cpu", "meta"])),
                Arg("partial", one(None, "sum")),
            ),
        ),
        "Layout.from_torch_metadata": Entry(
            Layout.from_torch_metadata, (Arg("metadata", one(HALVES.to_torch_metadata())),)
        ),
        "Layout.visualize": Entry(
            lambda layout, width, color: layout.visualize(width, color=color),
            (
                Arg("layout", one(HALVES, ROWS.layout), junk=None),
                Arg("width", one(60, 8), reject=_not_optional_int),
                Arg("color", one(False)),
            ),
        ),
        "spec.layout": Entry(
            lambda spec, shape: spec.layout(shape), (Arg("spec", SPECS[:12], junk=None), Arg("shape", one((3, 4))))
        ),
        "Chunk": Entry(Chunk, (Arg("dim", one(0, -1)), Arg("placements", one([0, 1], "rank:0/cpu", 2)))),
        "Replicated": Entry(Replicated, (Arg("placements", one([0, 1], 3)),)),
        "Single": Entry(Single, (Arg("placement", one(0, "rank:1/cpu", Placement(2))),)),
        "Explicit": Entry(Explicit, (Arg("shards", one([((0,), (2,), 0), ((2,), (2,), 1)], HALVES.shards)),)),
        "Mesh": Entry(Mesh, (Arg("shape", one((2, 2), [4])), Arg("ranks", one(None)), Arg("axis_names", one(None)))),
        "Named": Entry(Named, (Arg("mesh", one(Mesh((2, 2)))), Arg("partition", one(("x", None), ["y"], ())))),
        "Partial": Entry(Partial, (Arg("spec", one(Replicated([0, 1]), HALVES)), Arg("op", one("sum", "max")))),
        "Precision": Entry(
            fshard.Precision,
            (Arg("param", one(None, torch.bfloat16, torch.float64)), Arg("reduce", one(None, torch.float32))),
        ),
        "Shard": Entry(Shard, (Arg("meta", one(ShardMeta((0,), (2,), 0))), Arg("data", one(torch.zeros(2))))),
        "ShardedArray": Entry(
            fshard.ShardedArray,
            (
                Arg("layout", one(HALVES)),
                Arg("data", one([torch.zeros(2), torch.ones(2)])),
                Arg("backend", one(ROWS.backend)),
                kw("dtype", (None,), _not_optional_dtype),
                kw("link", (None,)),
            ),
        ),
        "ShardedArray.__repr__": Entry(
            repr, (Arg("array", ARRAYS, junk=st.one_of(st.builds(_meta_array), st.sampled_from(ARRAYS))),)
        ),
        "ShardedArray.size": Entry(
            lambda array, dim: array.size(dim), (Arg("array", ARRAYS, junk=None), Arg("dim", one(None, 0, -1)))
        ),
        "Plan": Entry(
            fshard.Plan,
            (
                Arg("src", one(HALVES)),
                Arg("dst", one(HALVES)),
                *(Arg(n, one(np.zeros(0, np.int64))) for n in ("src_shard", "dst_shard")),
                *(Arg(n, one(np.zeros((0, 1), np.int64))) for n in ("lo", "size")),
            ),
        ),
        "Transfer": Entry(
            fshard.Transfer,
            (
                *(Arg(n, one(0, 1)) for n in ("src_rank", "src_shard", "dst_rank", "dst_shard")),
                Arg("box", one(((0,), (2,)))),
            ),
        ),
        "plan": Entry(fshard.plan, (Arg("src", one(HALVES, ROWS.layout)), Arg("dst", one(HALVES, ROWS.layout)))),
        "Plan.for_rank": Entry(
            lambda plan, rank: plan.for_rank(rank),
            (
                Arg("plan", one(fshard.plan(HALVES, HALVES), fshard.plan(HALVES, SPECS[10].layout((4,)))), junk=None),
                Arg("rank", one(0, 1, 7), junk=rank_junk, reject=_not_optional_int),
            ),
        ),
        "RankSchedule": Entry(
            fshard.RankSchedule,
            tuple(Arg(f.name, one(getattr(SCHEDULE, f.name))) for f in dataclasses.fields(SCHEDULE)),
        ),
        "shard": Entry(
            fshard.shard,
            (
                Arg("tensor", one(T34), reject=_not_plain),
                Arg("spec", one(Chunk(0, [0, 1]), Replicated([0, 1]), ROWS.layout)),
                rank("src"),
                BACKEND,
            ),
        ),
        "gather": Entry(fshard.gather, (ARRAY, rank("dst"))),
        "reshard": Entry(
            fshard.reshard,
            (
                ARRAY,
                Arg("spec", one(Replicated([0, 1]), Replicated([2]))),
                kw("precision", (None, fshard.Precision(param=torch.bfloat16, reduce=torch.float32))),
            ),
        ),
        "map_local": Entry(
            fshard.map_local,
            (
                Arg("fn", one(FNS[0], FNS[1])),
                var("arrays", ((ROWS,), (ROWS, ROWS))),
                kw("out_spec", (None,)),
                flag("linear", (False,)),
            ),
        ),
        "shard_map": Entry(
            lambda fn, in_specs, out_specs, args, precision=None: fshard.shard_map(
                fn, in_specs, out_specs, precision=precision
            )(*args),
            (
                Arg("fn", one(FNS[0], torch.neg)),
                Arg("in_specs", one(Chunk(0, [0, 1]), (Chunk(0, [0, 1]),))),
                Arg("out_specs", one(Chunk(0, [0, 1]))),
                Arg("args", one((ROWS,), (T34,)), junk=var_junk),
                kw("precision", (None, fshard.Precision(param=torch.float64), (None,))),
            ),
        ),
        "equal": Entry(fshard.equal, (Arg("a", one(ROWS)), Arg("b", one(ROWS, ARRAYS[2])))),
        "allclose": Entry(
            fshard.allclose,
            (
                Arg("a", one(ROWS)),
                Arg("b", one(ROWS, ARRAYS[2])),
                Arg("rtol", one(1e-5)),
                Arg("atol", one(1e-8)),
                Arg("equal_nan", one(False, True), reject=_not_bool),
            ),
        ),
        "from_local_shards_and_layout": Entry(
            fshard.from_local_shards_and_layout,
            (shards(), Arg("layout", one(ROWS.layout)), BACKEND),
        ),
        "from_local_shards": Entry(
            fshard.from_local_shards,
            (
                shards(),
                Arg("shape", one((3, 4), [3, 4], torch.Size([3, 4]))),
                kw("group", (None,)),
            ),
        ),
        "from_local_tensor": Entry(
            fshard.from_local_tensor,
            (Arg("tensor", one(T34)), Arg("dim", one(0, 1, -1)), Arg("shape", one(None)), kw("group", (None,))),
        ),
        "zeros": Entry(fshard.zeros, creation),
        "ones": Entry(fshard.ones, creation),
        "empty": Entry(fshard.empty, creation),
        "full": Entry(fshard.full, (*creation, kw("fill_value", (0, 2.5, True)))),
        "rand": Entry(fshard.rand, (*creation, seed)),
        "randn": Entry(fshard.randn, (*creation, seed)),
        "zeros_like": Entry(fshard.zeros_like, like),
        "ones_like": Entry(fshard.ones_like, like),
        "empty_like": Entry(fshard.empty_like, like),
        "full_like": Entry(fshard.full_like, (ARRAY, Arg("fill_value", one(0, 1.5)), DTYPE, GRAD)),
        "rand_like": Entry(fshard.rand_like, (*like, seed)),
        "randn_like": Entry(fshard.randn_like, (*like, seed)),
        "to_dtensor": Entry(fshard.to_dtensor, (ARRAY, Arg("mesh", one(Mesh((2,)), Mesh((2, 2))))), ON_DIST),
        "to_sharded_tensor": Entry(fshard.to_sharded_tensor, (ARRAY,), ON_DIST),
        "from_dtensor": Entry(fshard.from_dtensor, (Arg("dt", one(None)),)),
        "from_sharded_tensor": Entry(fshard.from_sharded_tensor, (Arg("st", one(None)),)),
        "save": Entry(
            fshard.save,
            (
                Arg("path", new_dir, junk=path),
                Arg("tree", one({"w": ROWS, "n": 1}, [T34])),
                flag("progress", (None, False)),
            ),
        ),
        "save_safetensors": Entry(
            fshard.save_safetensors,
            (
                Arg("path", new_dir, junk=path),
                Arg("tree", one({"w": ROWS, "b": torch.ones(2)}, {"t": T34})),
                kw("max_shard_size", ("5GB", 1 << 20, "512MiB")),
            ),
        ),
        "Split": Entry(
            fshard.Split,
            (Arg("source", one("qkv")), Arg("dim", one(0, 1)), Arg("parts", one({"q": 2, "k": 1}, {"a": 0}))),
        ),
        "Concat": Entry(
            fshard.Concat,
            (Arg("sources", one(["q", "k"], ("a",))), Arg("dim", one(0, 1)), Arg("name", one("qk"))),
        ),
        "load": Entry(
            fshard.load,
            (
                Arg("path", one(str(ckpt), ckpt), junk=path),
                Arg("like", one(None)),
                Arg("specs", one(None, {"w": Chunk(1, [0, 1]), "b": None, "step": None})),
                flag("verify"),
                BACKEND,
                flag("progress", (None, False)),
            ),
        ),
        "checkpoint_info": Entry(fshard.checkpoint_info, (Arg("path", one(str(ckpt)), junk=path),)),
        "config": Entry(
            _configure,
            (
                flag("check_collectives", (False,)),
                kw("check_timeout", (60.0, 5)),
                Arg("changes", one({}), "kwargs", st.dictionaries(texts, garbage, min_size=1, max_size=2)),
            ),
        ),
        "clear_caches": Entry(fshard.clear_caches, ()),
        "global_norm": Entry(fshard.global_norm, (Arg("tree", one({"w": ROWS, "b": torch.ones(2)}, [ARRAYS[2]])),)),
        "check_replicas": Entry(
            fshard.check_replicas, (Arg("tree", one({"w": ROWS, "b": torch.ones(2)}, [ARRAYS[2]])),)
        ),
        "clip_grad_norm": Entry(
            fshard.clip_grad_norm,
            (Arg("tree", one({"w": ROWS}, [T34])), Arg("max_norm", one(1.0, 3)), Arg("eps", one(1e-6))),
        ),
        "shard_params": Entry(
            fshard.shard_params,
            (
                Arg("module_or_state_dict", lambda: torch.nn.Linear(4, 3)),
                Arg("spec_fn", one(lambda name, t: Chunk(0, [0, 1]), None)),
                BACKEND,
            ),
        ),
        "load_state_dict": Entry(
            fshard.load_state_dict,
            (
                Arg("module", lambda: torch.nn.Linear(4, 3)),
                Arg("tree", lambda: fshard.shard_params(torch.nn.Linear(4, 3))),
                flag("strict"),
            ),
        ),
        "replicated": Entry(fshard.replicated, (Arg("ranks", one([0, 1], (0, 1), "rank:0/cpu")),)),
        "fully_sharded": Entry(
            lambda ranks, dim: fshard.shard_module(MODEL, fshard.fully_sharded(ranks, dim)),
            (Arg("ranks", one([0, 1], (0, 1, 2), "rank:1/cpu")), Arg("dim", one(0, 1, -1))),
        ),
        "shard_module": Entry(
            fshard.shard_module,
            (Arg("module", lambda: torch.nn.Linear(4, 3)), Arg("rules", RULES), BACKEND),
        ),
        "apply_module": Entry(
            fshard.apply_module,
            (
                Arg("module", one(MODEL)),
                Arg("params", one(MODEL_PARAMS)),
                Arg("buffers", one(MODEL_BUFFERS)),
                Arg("args", ((BATCH,), (torch.ones(2, 4),), (BATCH, "text", 3)), "var", inputs_junk),
                kw("out_specs", (None,)),
                kw("method", (None, lambda m, *a, **k: m(*a, **k) * 2)),
                Arg("kwargs", one({}, {"extra": 1}), "kwargs", st.dictionaries(texts, garbage, min_size=1, max_size=2)),
            ),
        ),
        "optimizer_state": Entry(fshard.optimizer_state, (Arg("opt", _optimizer), Arg("params", one(OPT_PARAMS)))),
        "load_optimizer_state": Entry(
            fshard.load_optimizer_state,
            (Arg("opt", _optimizer), Arg("params", one(OPT_PARAMS)), Arg("state", _saved_state, junk=_state_junk())),
        ),
        "psum": Entry(
            functools.partial(_reduce, fshard.psum),
            (Arg("x", one(BLOCK), junk=tensor_junk), Arg("axis", one("x", ("x",), ["x"]))),
        ),
        "pmean": Entry(
            functools.partial(_reduce, fshard.pmean),
            (Arg("x", one(BLOCK), junk=tensor_junk), Arg("axis", one("x", ("x",), ["x"]))),
        ),
        "no_sync": Entry(_under_no_sync, ()),
        "discard_kept_aside": Entry(fshard.discard_kept_aside, (Arg("params", one({"w": ROWS}, [ARRAYS[2]], ROWS)),)),
        "backward": Entry(fshard.backward, (Arg("loss", _loss_array),)),
        "prefetch": Entry(
            _prefetch,
            (
                Arg("arrays", one(PREFETCHED, [PREFETCHED["w"]], PREFETCHED["w"])),
                Arg("spec", one(Replicated([0, 1]), Chunk(1, [0, 1]))),
                kw("precision", (None, fshard.Precision(param=torch.bfloat16))),
            ),
        ),
        "Prefetch": Entry(fshard.Prefetch, (Arg("pending", _pending),)),
        "tensor_parallel": Entry(
            lambda mesh, plan, **axes: fshard.shard_module(MLP, fshard.tensor_parallel(mesh, plan, **axes)),
            (
                Arg("mesh", one(TP_MESH)),
                Arg("plan", one({"0": "colwise", "2": "rowwise"}, {"0": "colwise"}, {})),
                kw("tp", ("tp",)),
                kw("dp", ("dp", None)),
                flag("fsdp"),
            ),
        ),
        "TensorParallel": Entry(
            fshard.TensorParallel,
            (
                Arg("mesh", one(TP_MESH)),
                Arg("plan", one((("0", "colwise"), ("2", "rowwise")), ()), reject=lambda v: not isinstance(v, tuple)),
                Arg("tp", one("tp")),
                Arg("dp", one("dp", None)),
                Arg("fsdp", one(False, True), reject=_not_bool),
            ),
        ),
    }


def _configure(**changes: Any) -> Any:
    """``fshard.config(**changes)``, then the settings as they were before."""
    before = fshard._config.current()
    try:
        return fshard.config(**changes)
    finally:
        fshard.config(**dataclasses.asdict(before))


def _dict_junk() -> st.SearchStrategy[Any]:
    """Garbage for ``Layout.from_dict``: anything, or a valid dict with one field replaced."""

    def edit(field: str, value: Any) -> dict[str, Any]:
        data = HALVES.to_dict()
        if field.startswith("shards."):
            data["shards"][0][field.removeprefix("shards.")] = value
        else:
            data[field] = value
        return data

    fields = st.sampled_from(("shape", "shards", "partial", "shards.offsets", "shards.sizes", "shards.placement"))
    return st.one_of(garbage, st.builds(edit, fields, garbage))


# -- calls and outcomes ------------------------------------------------------------------------


@contextlib.contextmanager
def _memory_cap(headroom: int = 2 << 30) -> Iterator[None]:
    """Caps the address space at its current size plus ``headroom`` while a call runs, so garbage
    that makes fshard allocate gigabytes fails fast instead of exhausting the machine (Linux only)."""
    statm = Path("/proc/self/statm")
    if resource is None or not statm.exists():
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = int(statm.read_text().split()[0]) * resource.getpagesize()
    cap = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@dataclasses.dataclass(frozen=True)
class Call:
    """One drawn call: the arguments and which of them are garbage."""

    entry: str
    values: dict[str, Any]
    garbled: tuple[str, ...]

    def run(self, spec: Entry) -> Any:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for a in spec.args:
            value = self.values[a.name]
            if a.kind == "pos":
                args.append(value)
            elif a.kind == "var":
                args.extend(value)
            elif a.kind == "kwargs":
                kwargs.update(value)
            else:
                kwargs[a.name] = value
        with warnings.catch_warnings(), _memory_cap():
            warnings.simplefilter("ignore")
            return spec.fn(*args, **kwargs)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={_short(self.values[k])}" for k in self.garbled)
        return f"{self.entry}({shown})"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        text = _tensor_text(value)
    elif isinstance(value, fshard.ShardedArray):
        text = f"ShardedArray({value.layout!r}, dtype={value.dtype})"
    else:
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _tensor_text(t: torch.Tensor) -> str:
    if t.is_nested:
        return f"nested tensor(dtype={t.dtype}, device={t.device})"
    return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}, layout={t.layout})"


@st.composite
def calls(draw: st.DrawFn, name: str, spec: Entry) -> Call:
    names = [a.name for a in spec.args if a.junk is not None]
    if not names:
        return Call(name, {a.name: draw(a.values) for a in spec.args}, ())
    first = draw(st.sampled_from(names))
    more = draw(st.sampled_from([*names, None, None, None])) if len(names) > 1 else None
    garbled = tuple(dict.fromkeys(n for n in (first, more) if n is not None))
    values = {a.name: draw(a.junk if a.name in garbled and a.junk is not None else a.values) for a in spec.args}
    return Call(name, values, garbled)


@functools.cache
def _raise_offsets(code: types.CodeType) -> frozenset[int]:
    """The bytecode offsets of ``code``'s ``raise`` statements."""
    return frozenset(i.offset for i in dis.get_instructions(code) if i.opname == "RAISE_VARARGS")


def _raised_by_fshard(exc: BaseException) -> bool:
    """True when the innermost frame of ``exc``'s traceback is a ``raise`` statement in fshard's code."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return str(Path(code.co_filename).resolve()).startswith(SOURCES) and tb.tb_lasti in _raise_offsets(code)


ALIASES = {
    "shape": ("size", "extent", "-d array", "-d local"),
    "placements": ("placement", "rank"),
    "placement": ("rank",),
    "shards": ("shard", "box"),
    "module_or_state_dict": ("module", "mapping"),
    "tree": ("leaf", "leaves", "at the root", "at ["),
    "data": ("layout dict", "shard"),
    "arrays": ("argument", "array"),
    "args": ("argument",),
    "in_specs": ("argument",),
    "path": ("checkpoint", "index"),
    "dim": ("spec",),
    "offsets": ("shardmeta", "shard", "cover"),
    "sizes": ("shardmeta", "shard", "cover"),
    "ranks": ("placement", "shard"),
    "dt": ("dtensor",),
    "st": ("shardedtensor",),
    "changes": ("setting",),
}


def _tokens(value: Any, depth: int = 0) -> Iterator[str]:
    """Texts whose appearance in a message names ``value``: its repr, str and type name (and its items')."""
    yield type(value).__name__
    if isinstance(value, torch.Tensor) and value.is_nested:  # its shape raises
        yield "nested"
        return
    if isinstance(value, torch.Tensor):
        yield from (str(value.dtype), str(value.device), str(value.layout), str(tuple(value.shape)))
        if value.device.type != "meta" and value.layout == torch.strided:
            yield repr(value)[:20]
        return
    if isinstance(value, fshard.ShardedArray):
        yield from (str(tuple(value.shape)), str(value.dtype), "partial", "pending")
        return
    text = _short(value)
    yield text[:40]
    if len(text) < 120:
        yield text
        yield str(value)
    if depth < 3 and isinstance(value, (list, tuple, dict, set, frozenset)):
        items = value.items() if isinstance(value, dict) else value
        for item in itertools.islice(items, 8):
            yield from _tokens(item, depth + 1)


def names_argument(message: str, name: str, value: Any) -> bool:
    """True when ``message`` names the argument: by name (or a synonym), or by its value or type."""
    lowered = message.lower()
    words = (name, name.replace("_", " "), name.removesuffix("s"), *ALIASES.get(name, ()))
    if any(w.lower() in lowered for w in words):
        return True
    return any(token and token in message for token in _tokens(value))


def _allocation_refused(exc: BaseException) -> bool:
    """The allocator refused a valid request (terabytes): a resource limit, not an argument error."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def verdict(call: Call, spec: Entry, exc: BaseException | None) -> str | None:
    """``None`` when the outcome keeps the contract, else what is wrong with it."""
    if exc is None:
        refused = [a.name for a in spec.args if a.name in call.garbled and a.reject and a.reject(call.values[a.name])]
        return f"accepted a bad {refused[0]}" if refused else None
    kind = type(exc).__name__
    if _allocation_refused(exc) or (spec.expected and spec.expected in str(exc)):
        return None
    if not isinstance(exc, fshard.FShardError) and not (isinstance(exc, DELIBERATE) and _raised_by_fshard(exc)):
        return f"{kind} (not raised by fshard on purpose)"
    if len(call.garbled) == 1:
        name = call.garbled[0]
        if not names_argument(str(exc), name, call.values[name]):
            return f"{kind} whose message does not name {name}"
    return None


def outcome(call: Call, spec: Entry) -> tuple[str | None, BaseException | None]:
    """What is wrong with the call's outcome (``None``: nothing), and the exception it raised."""
    try:
        call.run(spec)
    except Exception as exc:  # every exception is judged
        return verdict(call, spec, exc), exc
    return verdict(call, spec, None), None


# -- input classes that once broke the contract ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Known:
    """A class of garbage that once broke the contract.

    Attributes:
        id: a short name for the class.
        where: the ``(entry, argument)`` pairs it affects.
        matches: whether a garbage value belongs to the class.
        value: one concrete value of it, pinned per pair by ``test_once_failing_input``.
        reason: where it broke, and how.
    """

    id: str
    where: tuple[tuple[str, str], ...]
    matches: Callable[[Any], bool]
    value: Any
    reason: str


def _not_iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return True
    return False


def _box_of_scalars(value: Any) -> bool:
    """Boxes given as ``(offsets, sizes, placement)`` where offsets or sizes is not a sequence."""
    items = value if isinstance(value, (list, tuple)) else ()
    return any(
        isinstance(b, (list, tuple)) and len(b) == 3 and (_not_iterable(b[0]) or _not_iterable(b[1])) for b in items
    )


def _not_boxes(value: Any) -> bool:
    """Not a sequence of ``ShardMeta``s and ``(offsets, sizes, placement)`` triples."""
    if _not_iterable(value):
        return True
    return any(not isinstance(b, ShardMeta) and (_not_iterable(b) or len(list(b)) != 3) for b in value)


def _not_an_array(value: Any) -> bool:
    """numpy cannot make an array of ``value`` (ragged nesting, say)."""
    try:
        np.asarray(value)
    except (TypeError, ValueError, RuntimeError):
        return True
    return False


def _holds_array(value: Any) -> bool:
    """``value`` is or holds a tensor or a numpy value (which a str index makes raise IndexError)."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return any(_holds_array(v) for v in items)


def _unhashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return True
    return False


def _not_real(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float))


def _not_callable(value: Any) -> bool:
    return not callable(value)


def _not_backend(value: Any) -> bool:
    return value is not None and not isinstance(value, fshard.backends.Backend)


def _on_meta(value: Any) -> bool:
    return isinstance(value, fshard.ShardedArray) and any(t.device.type == "meta" for t in value.addressable_data)


CREATORS = ("zeros", "ones", "empty", "full", "rand", "randn")
KNOWN: tuple[Known, ...] = (
    Known(
        "shape-not-a-sequence",
        (
            ("Layout", "shape"),
            ("ShardMeta", "offsets"),
            ("ShardMeta", "sizes"),
            ("Mesh", "shape"),
            ("spec.layout", "shape"),
            ("Layout.from_arrays", "shape"),
        ),
        _not_iterable,
        None,
        "fshard/_layout/layout.py check_shape: tuple(shape) raises Python's TypeError for a non-iterable shape",
    ),
    Known(
        "box-of-scalars",
        (("Layout", "shards"), ("Explicit", "shards")),
        _box_of_scalars,
        [(None, (2,), 0)],
        "fshard/_layout/layout.py check_shape (via as_metas/ShardMeta): offsets or sizes that are not sequences",
    ),
    Known(
        "shards-not-boxes",
        (("Layout", "shards"),),
        _not_boxes,
        [(0,), "ab"],
        "fshard/_layout/layout.py as_metas: tuple(shards) and ShardMeta(*box) raise Python's TypeError",
    ),
    Known(
        "columns-not-arrays",
        (("Layout.from_arrays", "offsets"), ("Layout.from_arrays", "sizes"), ("Layout.from_arrays", "ranks")),
        _not_an_array,
        [[2, [1]], [2]],
        "fshard/_layout/layout.py Layout.from_arrays (_int_columns): numpy's ValueError/TypeError for ragged columns",
    ),
    Known(
        "devices-not-a-sequence",
        (("Layout.from_arrays", "devices"),),
        lambda v: not isinstance(v, str) and _not_iterable(v),
        5,
        "fshard/_layout/layout.py Layout.from_arrays (_device_column): Python's TypeError for a non-iterable devices",
    ),
    Known(
        "layout-dict-with-arrays",
        (("Layout.from_dict", "data"),),
        _holds_array,
        {"shape": [4], "shards": torch.ones(2, 2)},
        "fshard/_layout/layout.py Layout.from_dict: indexing a tensor raises IndexError, which is not caught",
    ),
    Known(
        "shard-meta-not-a-shardmeta",
        (("Shard", "meta"),),
        lambda v: not isinstance(v, ShardMeta),
        None,
        "fshard/_array/array.py Shard.__post_init__: meta is used before it is checked (AttributeError)",
    ),
    Known(
        "array-layout",
        (("ShardedArray", "layout"),),
        lambda v: not isinstance(v, Layout),
        None,
        "fshard/_array/array.py ShardedArray.__init__: layout is used before it is checked (AttributeError)",
    ),
    Known(
        "array-backend",
        (("ShardedArray", "backend"),),
        lambda v: not isinstance(v, fshard.backends.Backend),
        None,
        "fshard/_array/array.py ShardedArray.__init__: backend is used before it is checked (AttributeError)",
    ),
    Known(
        "array-data-not-a-sequence",
        (("ShardedArray", "data"),),
        _not_iterable,
        None,
        "fshard/_array/array.py ShardedArray.__init__: tuple(data) raises Python's TypeError",
    ),
    Known(
        "array-dtype",
        (("ShardedArray", "dtype"),),
        _not_optional_dtype,
        "float32",
        "fshard/_array/array.py ShardedArray.__init__: a dtype that is not a torch.dtype is accepted",
    ),
    Known(
        "size-dim",
        (("ShardedArray.size", "dim"),),
        lambda v: v is not None and not isinstance(v, int),
        (4,),
        "fshard/_array/array.py ShardedArray.size: a dim that is not an int reaches a comparison (Python's TypeError)",
    ),
    Known(
        "repr-on-meta",
        (("ShardedArray.__repr__", "array"),),
        _on_meta,
        _meta_array(),
        "fshard/_array/array.py _values: copies shard values off the meta device (NotImplementedError)",
    ),
    Known(
        "allclose-tolerances",
        (("allclose", "rtol"), ("allclose", "atol")),
        _not_real,
        "x",
        "fshard/_api/move.py allclose: rtol/atol reach torch.allclose unchecked (torch's TypeError)",
    ),
    Known(
        "allclose-equal-nan",
        (("allclose", "equal_nan"),),
        _not_bool,
        "x",
        "fshard/_api/move.py allclose: equal_nan reaches torch.allclose unchecked (torch's TypeError)",
    ),
    Known(
        "backend-not-a-backend",
        (
            *((c, "backend") for c in CREATORS),
            ("shard", "backend"),
            ("from_local_shards_and_layout", "backend"),
            ("shard_params", "backend"),
        ),
        _not_backend,
        (1,),
        "fshard/_api/move.py resolve_backend: a backend= that is not a Backend is used as one (AttributeError)",
    ),
    Known(
        "fn-not-callable",
        (("map_local", "fn"), ("shard_map", "fn")),
        _not_callable,
        None,
        "fshard/_api/map.py map_local/shard_map: fn is called without a check (Python's TypeError)",
    ),
    Known(
        "linear-not-a-bool",
        (("map_local", "linear"),),
        _not_bool,
        None,
        "fshard/_api/map.py map_local: linear= that is not a bool is read for its truth value",
    ),
    Known(
        "quantized-or-nested-tensor",
        (("shard", "tensor"),),
        _not_plain,
        _quantized(),
        "fshard/_api/shard.py shard: a quantized tensor was accepted (repr and reshard then raised inside torch), "
        "a nested one raised torch's RuntimeError",
    ),
    Known(
        "meta-tensor-onto-cpu",
        (("shard", "tensor"),),
        lambda v: isinstance(v, torch.Tensor) and v.device.type == "meta",
        torch.ones(3, 4, device="meta"),
        "fshard/_api/shard.py shard: a meta tensor was copied onto cpu placements (torch's NotImplementedError)",
    ),
    Known(
        "empty-shape-overflowing",
        tuple((c, "shape") for c in CREATORS),
        lambda v: isinstance(v, tuple) and 0 in v and all(isinstance(n, int) and n >= 0 for n in v),
        (2**40, 2**40, 0),
        "fshard/_api/creation.py _check_sizes: an empty shard's other extents were not counted "
        "(torch's 'Storage size calculation overflowed')",
    ),
    Known(
        "devices-item-unhashable",
        (("Layout.from_arrays", "devices"),),
        lambda v: not isinstance(v, str) and not _not_iterable(v) and any(_unhashable(d) for d in v),
        [["cpu"], "cpu"],
        "fshard/_layout/validate.py device_column: set() of the names raises Python's TypeError for a list item",
    ),
    Known(
        "plan-unhashable",
        (("plan", "src"), ("plan", "dst")),
        _unhashable,
        [1],
        "fshard/_plan/direct.py plan: the lru_cache hashes the arguments before they are checked (Python's TypeError)",
    ),
    Known(
        "rank-past-int64",
        (("Placement", "rank"), ("fully_sharded", "ranks")),
        lambda v: _int_past_int64(v) or (isinstance(v, list) and any(_int_past_int64(r) for r in v)),
        2**63,
        "fshard/_layout/placement.py Placement: a rank of 2**63 or more was accepted, and no Layout can hold it "
        "(numpy's OverflowError when fully_sharded's specs were laid out)",
    ),
    Known(
        "ranks-not-a-sequence",
        (("replicated", "ranks"), ("fully_sharded", "ranks")),
        lambda v: not isinstance(v, (str, int)) and _not_iterable(v),
        None,
        "fshard/_api/module_rules.py replicated/fully_sharded: list(ranks) raises Python's TypeError",
    ),
    Known(
        "fully-sharded-dim-past-ndim",
        (("fully_sharded", "dim"),),
        lambda v: isinstance(v, int) and v not in (0, -1),
        1,
        "fshard/_api/module_rules.py fully_sharded: the rule read t.shape[dim] of tensors without that dim "
        "(a bias when dim=1: Python's IndexError); they are replicated now",
    ),
    Known(
        "apply-module-method",
        (("apply_module", "method"),),
        lambda v: v is not None and not callable(v),
        3,
        "fshard/_api/module_apply.py apply_module: method was called unchecked inside the body (Python's TypeError)",
    ),
    Known(
        "apply-module-on-meta",
        (("apply_module", "args"),),
        lambda v: isinstance(v, tuple) and any(_on_meta(a) for a in v),
        (_meta_array(),),
        "fshard/_api/module_apply.py apply_module: on meta placements, the updated buffers were resharded back "
        "onto cpu (torch's NotImplementedError: cannot copy out of meta tensor)",
    ),
    Known(
        "optimizer-not-an-optimizer",
        (("optimizer_state", "opt"), ("load_optimizer_state", "opt")),
        lambda v: not isinstance(v, torch.optim.Optimizer),
        None,
        "fshard/_api/optim.py optimizer_state/load_optimizer_state: opt.param_groups read unchecked (AttributeError)",
    ),
    Known(
        "optimizer-state-parts",
        (("load_optimizer_state", "state"),),
        lambda v: isinstance(v, dict) and set(v) == {"state", "param_groups"},
        {"state": [1], "param_groups": [{"arrays": 5}]},
        "fshard/_api/optim.py load_optimizer_state: state['state'].items() (AttributeError) and "
        "list(param_groups), hyper.get('arrays') (Python's TypeError, AttributeError) read unchecked",
    ),
    Known(
        "reduce-axis-not-names",
        (("psum", "axis"), ("pmean", "axis")),
        lambda v: not isinstance(v, (str, tuple, list)) or any(_unhashable(a) for a in v),
        None,
        "fshard/_api/psum.py _enter: tuple(axis) of a non-sequence and set(axes) of unhashable items "
        "(Python's TypeError)",
    ),
    Known(
        "reduce-tensor-not-strided",
        (("psum", "x"), ("pmean", "x")),
        lambda v: isinstance(v, torch.Tensor) and (v.layout != torch.strided or v.is_quantized or v.is_nested),
        _quantized(),
        "fshard/_api/psum.py psum/pmean: quantized, nested and (for pmean) sparse CSR tensors reached torch's "
        "sum (torch's NotImplementedError and RuntimeError)",
    ),
    Known(
        "tensor-parallel-fields",
        (("TensorParallel", "mesh"), ("TensorParallel", "plan")),
        lambda v: not isinstance(v, (Mesh, tuple)),
        None,
        "fshard/_api/module_tp.py TensorParallel: mesh.axis_names read unchecked (AttributeError), and a plan that "
        "is no tuple of (pattern, style) pairs accepted",
    ),
    Known(
        "tensor-parallel-fsdp",
        (("tensor_parallel", "fsdp"), ("TensorParallel", "fsdp")),
        _not_bool,
        None,
        "fshard/_api/module_tp.py tensor_parallel: bool(fsdp) accepted any value (a tensor's truth value raised "
        "torch's RuntimeError)",
    ),
)


# -- the tests --------------------------------------------------------------------------------


def _is_error_type(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseException)


PUBLIC = sorted(n for n in fshard.__all__ if callable(getattr(fshard, n)) and not _is_error_type(getattr(fshard, n)))
METHODS = (
    "Placement.parse",
    "Plan.for_rank",
    "Layout.from_arrays",
    "Layout.from_dict",
    "Layout.from_torch_metadata",
    "Layout.visualize",
    "spec.layout",
    "ShardedArray.size",
    "ShardedArray.__repr__",
)
TALLY: collections.Counter[tuple[str, str]] = collections.Counter()
SAMPLES: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Entry]]:
    yield entries(tmp_path_factory.mktemp("fuzz"))
    if REPORT:
        _print_report()


def test_every_public_callable_is_fuzzed(table: dict[str, Entry]) -> None:
    missing = [n for n in PUBLIC if n not in table]
    assert not missing, f"public callables without a fuzz entry: {missing}; add them to entries()"
    assert sorted(table) == sorted({*PUBLIC, *METHODS})


@pytest.mark.parametrize("name", [*PUBLIC, *METHODS])
def test_fuzz(name: str, table: dict[str, Entry]) -> None:
    if name not in table:
        pytest.fail(f"{name} has no fuzz entry: add it to entries()")
    spec = table[name]

    @FUZZ
    @given(call=calls(name, spec))
    def check(call: Call) -> None:
        bad, exc = outcome(call, spec)
        TALLY[(name, "tried")] += 1
        if bad is None:
            return
        TALLY[(name, bad)] += 1
        SAMPLES.setdefault((name, bad), f"{call!r} -> {type(exc).__name__}: {str(exc)[:300]}")
        if not REPORT:
            raise AssertionError(f"{call!r} broke the error contract: {bad}: {exc!r}") from exc

    check()


KNOWN_CASES = [pytest.param(k, entry, arg, id=f"{k.id}-{entry}-{arg}") for k in KNOWN for entry, arg in k.where]


@pytest.mark.parametrize(("case", "entry", "arg"), KNOWN_CASES)
def test_once_failing_input(case: Known, entry: str, arg: str, table: dict[str, Entry]) -> None:
    spec = table[entry]
    call = Call(entry, {a.name: case.value if a.name == arg else a.default() for a in spec.args}, (arg,))
    bad, exc = outcome(call, spec)
    assert bad is None, f"{call!r} broke the error contract: {bad}: {exc!r}"


def _print_report() -> None:
    tried = sum(v for (_, k), v in TALLY.items() if k == "tried")
    skipped = {key: v for key, v in TALLY.items() if key[1].startswith("known: ")}
    bad = {key: v for key, v in TALLY.items() if key[1] != "tried" and key not in skipped}
    print(f"\nfuzz: {tried} inputs tried, {sum(bad.values())} bad outcomes, {sum(skipped.values())} known skipped")
    by_type: collections.Counter[str] = collections.Counter()
    for (_, kind), v in bad.items():
        by_type[kind] += v
    for kind, v in by_type.most_common():
        print(f"  {v:6d} {kind}")
    for (name, kind), v in sorted(bad.items()):
        print(f"  {name:28s} {v:5d} {kind}\n      e.g. {SAMPLES[(name, kind)]}")
    for (name, kind), v in sorted(skipped.items()):
        print(f"  skipped {name:20s} {v:5d} {kind}")


# -- lazy views: accepted, and their values (not their bits) are what is sharded ---------------

VIEWS: dict[str, Callable[[], torch.Tensor]] = {
    "conj": lambda: torch.complex(T34, -T34).conj(),
    "conj-imag": lambda: torch.complex(T34, -T34).conj().imag,
    "neg-view": lambda: torch._neg_view(T34),
    "conj-transposed": lambda: torch.complex(T34, T34 + 1).conj().t(),
    "conj-rows": lambda: torch.complex(T34, T34 + 1).conj()[1:],
}
VIEW_SPECS = (Chunk(0, [0, 1]), Chunk(1, [0, 1, 2]), Replicated([0, 1]), Single(1), Partial(Replicated([0, 1])))


@FUZZ
@given(view=st.sampled_from(sorted(VIEWS)), spec=st.sampled_from(VIEW_SPECS), src=st.sampled_from((None, 0, 1)))
def test_lazy_views_shard_to_their_values(view: str, spec: Any, src: int | None) -> None:
    x = VIEWS[view]()
    want = x.resolve_conj().resolve_neg()
    a = fshard.shard(x, spec, src=src)
    assert not any(t.is_conj() or t.is_neg() for t in a.addressable_data)
    assert torch.equal(fshard.gather(a), want)
    assert torch.equal(fshard.gather(fshard.map_local(torch.conj, a, linear=True)), want.conj().resolve_conj())
