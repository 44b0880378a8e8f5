"""A module's parameters and buffers as arrays, sharded by rules: name patterns, or a function, to specs.

A module's structure (which names its parameters and buffers have, which names are tied to
one tensor, which buffers its forward may update) is read once per module object and cached
on its identity; it is read again when a tensor or submodule of the module was replaced.
"""

# The public functions check their arguments at run time, whatever the annotations promise.
# pyright: reportUnnecessaryIsInstance=false

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from fshard._api.module_tp import TensorParallel
from fshard._api.move import refuse_lazy
from fshard._api.shard import shard
from fshard._array.array import ShardedArray
from fshard._errors import SpecError
from fshard._exec.collective import collective
from fshard._layout.layout import Layout
from fshard._layout.show import describe_layout
from fshard._layout.specs import Chunk, Replicated, as_layout
from fshard.backends import Backend

__all__ = ["Structure", "fully_sharded", "replicated", "shard_module", "structure"]

Rules = Mapping[str, Any] | Callable[[str, torch.Tensor], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Structure:
    """What a module's forward reads: one entry per (submodule, local name), and the names of its tensors.

    ``slots`` holds, per submodule object (by ``id``), its parameters' and buffers' local
    names paired with the dotted name of the array that fills them: a tied tensor's first
    name (``named_parameters()`` order) in every place it is reached. ``homes`` gives each
    buffer's first (submodule ``id``, local name), where an in-place update is read back.
    It holds no reference to the module or its tensors.
    """

    params: tuple[str, ...]
    buffers: tuple[str, ...]
    ties: tuple[tuple[str, str], ...]  # (alias, the name of the array it reads)
    updated: tuple[str, ...]  # buffers the forward may update: persistent, of a module in training mode (_updatable)
    read_only: tuple[str, ...]  # the other buffers, which the forward may neither update nor replace
    slots: Mapping[int, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]]
    homes: Mapping[str, tuple[int, str]]
    shapes: Mapping[str, tuple[int, ...]]  # each parameter's and buffer's shape, by its first name


_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[Any, ...], Structure]] = weakref.WeakKeyDictionary()


def structure(module: torch.nn.Module) -> Structure:
    """The module's ``Structure``, cached on the module object while what it holds stays the same."""
    try:
        key = _fingerprint(module)
    except RuntimeError:  # a lazy module's parameter has no shape: _read names it
        _read(module)
        raise
    hit = _CACHE.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    built = _read(module)
    _CACHE[module] = (key, built)
    return built


def _fingerprint(module: torch.nn.Module) -> tuple[Any, ...]:
    """Every submodule's mode, and the names, identities and shapes of what it holds: all that ``_read`` reads.

    A shape, since a tensor's ``.data`` may be replaced by one of another shape (a layer pruned
    in place) while the tensor stays the same object.

    Made at every ``apply_module`` call, so in one loop over the submodules (as ``modules()``
    yields them, without its generator and names), each dict read in C.
    """
    out: list[Any] = []
    seen: set[int] = set()
    todo = [module]
    while todo:
        sub = todo.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        state = vars(sub)
        params, buffers, children = state["_parameters"], state["_buffers"], state["_modules"]
        out += (
            id(sub), sub.training, tuple(state["_non_persistent_buffers_set"]),
            tuple(params), tuple(map(id, params.values())), tuple(map(_shape, params.values())),
            tuple(buffers), tuple(map(id, buffers.values())), tuple(map(_shape, buffers.values())),
            tuple(children), tuple(map(id, children.values())),
        )  # fmt: skip
        todo += [m for m in reversed(children.values()) if m is not None]
    return tuple(out)


def _shape(t: torch.Tensor | None) -> torch.Size | None:
    return None if t is None else t.shape


def _read(module: torch.nn.Module) -> Structure:
    """The module's ``Structure``.

    Raises:
        SpecError: one tensor is registered as a parameter under one name and as a buffer under
            another (fshard trains and shards the one, keeps the other as state: it cannot be both).
    """
    first: dict[int, str] = {}
    kinds: dict[int, str] = {}  # the kind of a tensor's first registration
    shapes: dict[str, tuple[int, ...]] = {}
    ties: list[tuple[str, str]] = []
    slots: dict[int, tuple[list[tuple[str, str]], list[tuple[str, str]]]] = {}
    homes: dict[str, tuple[int, str]] = {}
    updated: list[str] = []
    buffers: list[str] = []
    for path, sub in module.named_modules(remove_duplicate=False):  # pyright: ignore[reportUnknownVariableType]
        sub = cast("torch.nn.Module", sub)
        params, bufs = slots.setdefault(id(sub), ([], []))
        fill = not params and not bufs
        for kind, table, out in (("_parameters", sub._parameters, params), ("_buffers", sub._buffers, bufs)):  # pyright: ignore[reportPrivateUsage]
            for local, t in table.items():
                if t is None:
                    continue
                name = f"{path}.{local}" if path else local
                refuse_lazy(t, f"{name!r}")
                key = first.setdefault(id(t), name)
                shapes.setdefault(key, tuple(t.shape))
                if kinds.setdefault(id(t), kind) != kind:
                    raise SpecError(_both_kinds_message(key, name, kind))
                if key != name:
                    ties.append((name, key))
                elif kind == "_buffers":
                    buffers.append(name)
                    homes[name] = (id(sub), local)
                    if sub.training and local not in sub._non_persistent_buffers_set and _updatable(t):  # pyright: ignore[reportPrivateUsage]
                        updated.append(name)
                if fill:
                    out.append((local, key))
    params_names = tuple(n for n in dict.fromkeys(first.values()) if n not in homes)
    frozen = {k: (tuple(p), tuple(b)) for k, (p, b) in slots.items()}
    changing = set(updated)
    read_only = tuple(n for n in buffers if n not in changing)
    return Structure(params_names, tuple(buffers), tuple(ties), tuple(updated), read_only, frozen, homes, shapes)


def _both_kinds_message(first: str, second: str, kind: str) -> str:
    """The error of one tensor registered as a parameter (``first`` or ``second``) and as a buffer (the other)."""
    param, buffer = (second, first) if kind == "_parameters" else (first, second)
    return (
        f"The module registers one tensor as parameter {param!r} and as buffer {buffer!r}: fshard shards and "
        "trains a parameter and keeps a buffer as state, so one tensor cannot be both. Register it once (read "
        f"{param!r} where {buffer!r} is used), or register a copy as the buffer."
    )


def _updatable(t: torch.Tensor) -> bool:
    """Whether a buffer like ``t`` has a value combined over placements: a real or bool dtype, not quantized."""
    return not (t.is_complex() or t.is_quantized)


# -- rules ------------------------------------------------------------------------------------


def replicated(ranks: Sequence[Any]) -> Callable[[str, torch.Tensor], Any]:
    """The rules of data parallelism: every parameter and buffer ``Replicated`` over ``ranks``.

    >>> import torch, fshard
    >>> params, buffers = fshard.shard_module(torch.nn.Linear(4, 2), fshard.replicated([0, 1]))
    >>> params["weight"].layout.is_fully_replicated
    True
    """
    spec = Replicated(_ranks(ranks, "replicated"))
    return lambda name, t: spec


def fully_sharded(ranks: Sequence[Any], dim: int = 0) -> Callable[[str, torch.Tensor], Any]:
    """The rules of a fully-sharded program: every tensor split ``Chunk(dim)`` over ``ranks``.

    A tensor without dim ``dim`` (a 0-D counter, a bias when ``dim=1``), or one whose ``dim``
    is shorter than the number of ranks (some rank would hold nothing: a LayerNorm's weight
    on more ranks than features), is ``Replicated`` over ``ranks`` instead.

    >>> import torch, fshard
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    >>> params, buffers = fshard.shard_module(model, fshard.fully_sharded([0, 1]))
    >>> [tuple(s.data.shape) for s in params["0.weight"].addressable_shards]
    [(3, 4), (3, 4)]
    >>> buffers["1.num_batches_tracked"].layout.is_fully_replicated
    True
    """
    split = Chunk(dim, _ranks(ranks, "fully_sharded"))
    whole = Replicated(split.placements)
    n = len(split.placements)

    def rule(name: str, t: torch.Tensor) -> Any:
        return split if -t.ndim <= dim < t.ndim and t.shape[dim] >= n else whole

    return rule


def _ranks(ranks: Any, what: str) -> Any:
    """``ranks`` of a rule helper, refused where it is an int: ``fully_sharded(4)`` reads as four ranks, not rank 4."""
    if isinstance(ranks, (int, np.integer)):
        msg = (
            f"fshard.{what}() takes a sequence of ranks, got {ranks!r}: give list(range({ranks!r})) for that many "
            f"ranks, or [{ranks!r}] for the one rank."
        )
        raise SpecError(msg)
    return ranks


@collective("shard_module")
def shard_module(
    module: torch.nn.Module, rules: Rules, *, backend: Backend | None = None
) -> tuple[dict[str, ShardedArray], dict[str, ShardedArray]]:
    """A module's parameters and buffers as two dicts of arrays, each laid out by the first rule that names it.

    ``rules`` is a mapping of ``fnmatch`` patterns (``"blocks.*.fc.weight"``, ``"*"``) to
    specs, tried in order, or a function ``(name, tensor) -> spec | None`` (``None``: no
    rule). Every parameter needs a rule; a buffer that none names is ``Replicated`` over the
    parameters' placements. A parameter reached under several names (tied weights: a
    language model's embedding and head) is one array, under its first name: ``apply_module``
    uses it in every place, so its gradient is the sum of its uses (a Parameter that two
    modules sharded apart share, such as stages of one model, is two arrays: the second
    call warns). Parameter arrays require grad where the module's parameters do; buffers never do.

    Pure: the module is not changed and the arrays share no memory with it. Every rank
    passes the full tensors and slices its own boxes: nothing is sent.

    Args:
        module: the ``torch.nn.Module`` to read.
        rules: patterns to specs, or a function of name and tensor; ``fshard.replicated(ranks)``,
            ``fshard.fully_sharded(ranks)`` and ``fshard.tensor_parallel(mesh, plan)`` give the
            common ones.
        backend: for the arrays (default: torch_dist when initialised, else local).

    Returns:
        ``(params, buffers)``: dotted names (``named_parameters()`` order) to ``ShardedArray``.

    Raises:
        SpecError: a parameter that no rule names, a pattern that names nothing, or a spec
            that does not fit its tensor (a tensor-parallel pattern that names no Linear);
            the message names the entry and the fix.

    >>> import torch, fshard
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    >>> rules = {"0.weight": fshard.Chunk(0, [0, 1]), "*": fshard.Replicated([0, 1])}
    >>> params, buffers = fshard.shard_module(model, rules)
    >>> list(params), list(buffers)
    (['0.weight', '0.bias', '1.weight', '1.bias'], ['1.running_mean', '1.running_var', '1.num_batches_tracked'])
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"shard_module() takes a torch.nn.Module, got {type(module).__name__}.")
    rule_of = _rule_function(rules)
    found = structure(module)
    if isinstance(rules, TensorParallel):
        rules.check(module)
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    specs = {name: rule_of(name, tensors[name]) for name in (*found.params, *found.buffers)}
    _check_unused(rules, (*found.params, *found.buffers, *(a for a, _ in found.ties)))
    missing = [name for name in found.params if specs[name] is None]
    if missing:
        msg = (
            f"shard_module() rules give no spec for parameter {missing[0]!r} ({len(missing)} without one: "
            f"{missing[:5]}); add a rule that names it, or a catch-all '*' last."
        )
        raise SpecError(msg)
    layouts = {name: _fit(name, spec, tensors[name]) for name, spec in specs.items() if spec is not None}
    _check_ties(rule_of, found, tensors, layouts)
    default = _default_buffer_spec(layouts, found)
    params = {name: _param(tensors[name], layouts[name], backend) for name in found.params}
    buffers = {n: _buffer(n, tensors[n], layouts, default, backend) for n in found.buffers}
    _note_sharded(module, {name: tensors[name] for name in found.params})
    return params, buffers


# Each parameter that shard_module has made an array of, by the parameter, weakly: the module it read it in
# (weakly) and its name there.
_SHARDED: Any = WeakIdKeyDictionary()


def _note_sharded(module: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Warns where a parameter was made an array of before, reading another module that is still alive.

    A model split into stages (the embeddings, the blocks, the head), each sharded on its own,
    makes two arrays of a Parameter that two stages share (a head tied to the embedding):
    trained apart, the tie is lost. Sharding one module again, or a module after another one
    has been let go, is not warned of.
    """
    for name, t in params.items():
        before = _SHARDED.get(t)
        if before is not None:
            other = before[0]()
            if other is not None and other is not module:
                warnings.warn(
                    f"shard_module(): parameter {name!r} of this {type(module).__name__} was made an array before "
                    f"as {before[1]!r} of a {type(other).__name__} (a weight tied across stages?). The two arrays "
                    "are trained apart, so the tie is lost: shard the shared Parameter once and pass that array "
                    "to both stages' apply_module (params={..., name: array}).",
                    UserWarning,
                    stacklevel=5,
                )
        _SHARDED[t] = (weakref.ref(module), name)


def _rule_function(rules: Any) -> Callable[[str, torch.Tensor], Any]:
    if isinstance(rules, Mapping):
        table = list(cast("Mapping[Any, Any]", rules).items())
        bad = next((k for k, _ in table if not isinstance(k, str)), None)
        if bad is not None:
            raise TypeError(f"shard_module() rules keys must be fnmatch patterns (str), got {bad!r}.")
        return lambda name, t: next((spec for pattern, spec in table if fnmatch.fnmatchcase(name, pattern)), None)
    if callable(rules):
        return cast("Callable[[str, torch.Tensor], Any]", rules)
    msg = (
        "shard_module() rules must be a mapping of name patterns to specs or a function (name, tensor) -> spec, "
        f"got {type(rules).__name__}."
    )
    raise TypeError(msg)


def _check_ties(
    rule_of: Callable[[str, torch.Tensor], Any],
    found: Structure,
    tensors: Mapping[str, torch.Tensor],
    layouts: Mapping[str, Layout],
) -> None:
    """Raises where the rules give a tied tensor's other name another layout than its first name's.

    A tied tensor is one array, laid out by the rule for its first name: a rule for another of
    its names that gives another layout would be ignored.
    """
    for alias, name in found.ties:
        spec = rule_of(alias, tensors[name])
        if spec is None or name not in layouts:
            continue
        wanted = _fit(alias, spec, tensors[name])
        if wanted != layouts[name]:
            msg = (
                f"shard_module() rules lay out {alias!r} as {describe_layout(wanted)}, but it is tied to {name!r} "
                f"(the same tensor), which they lay out as {describe_layout(layouts[name])}: a tied tensor is one "
                f"array, laid out by the rule for its first name {name!r}. Give that name the layout you want, or "
                "both names the same spec."
            )
            raise SpecError(msg)


def _check_unused(rules: Any, names: Sequence[str]) -> None:
    if not isinstance(rules, Mapping):
        return
    for pattern in cast("Mapping[str, Any]", rules):
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            msg = (
                f"shard_module() rule {pattern!r} names no parameter or buffer of the module (it has "
                f"{list(names)[:6]}{'...' if len(names) > 6 else ''}); fix the pattern or remove the rule."
            )
            raise SpecError(msg)


def _fit(name: str, spec: Any, t: torch.Tensor) -> Layout:
    kind = "buffer" if not isinstance(t, torch.nn.Parameter) else "parameter"
    try:
        return as_layout(spec, tuple(t.shape))
    except (ValueError, TypeError, IndexError) as exc:
        msg = (
            f"shard_module() rules give {kind} {name!r} (shape {tuple(t.shape)}, {t.dtype}) the spec {spec!r}, "
            f"which does not fit it: {exc} Give it another spec with an earlier rule "
            f"(e.g. {{{name!r}: fshard.Replicated(ranks), ...}}), or use fshard.fully_sharded(ranks), "
            "which replicates tensors too small to split."
        )
        raise SpecError(msg) from exc


def _default_buffer_spec(layouts: Mapping[str, Layout], found: Structure) -> Callable[[str, torch.Tensor], Layout]:
    placements = list(dict.fromkeys(s.placement for n in found.params for s in layouts[n].shards))

    def default(name: str, t: torch.Tensor) -> Layout:
        if not placements:
            msg = (
                f"shard_module() rules give no spec for buffer {name!r} and the module has no parameters "
                "to replicate it over: add a rule for it."
            )
            raise SpecError(msg)
        return Replicated(placements).layout(tuple(t.shape))

    return default


def _param(p: torch.Tensor, layout: Layout, backend: Backend | None) -> ShardedArray:
    out = shard(p.detach(), layout, backend=backend)
    if p.requires_grad:
        for t in out.addressable_data:
            t.requires_grad_()
        if not out.addressable_data:  # no shard here: the link carries requires_grad, as the shards do elsewhere
            out._first().requires_grad_()  # pyright: ignore[reportPrivateUsage]  # package-internal
    return out


def _buffer(
    name: str,
    t: torch.Tensor,
    layouts: Mapping[str, Layout],
    default: Callable[[str, torch.Tensor], Layout],
    backend: Backend | None,
) -> ShardedArray:
    layout = layouts.get(name)
    return shard(t.detach(), default(name, t) if layout is None else layout, backend=backend)
