"""Running a module on sharded parameters: a functional clone of the module per placement, inside ``shard_map``.

The clone (``module_clone``) holds the placement's blocks: nothing is swapped into the
module and back, so code that runs the module again later (the recomputation of
``torch.utils.checkpoint`` in the backward) sees the same tensors as the forward did.
"""

# The public functions check their arguments at run time, whatever the annotations promise.
# pyright: reportUnnecessaryIsInstance=false

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, cast

import optree
import torch

from fshard._api.map import named_shard_map
from fshard._api.map_out import check_out_specs
from fshard._api.module_clone import clone_tree
from fshard._api.module_rules import Structure, structure
from fshard._api.module_tp import TensorParallel
from fshard._api.move import reshard
from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._base.compile import body as compiled_where_called
from fshard._base.compile import opaque
from fshard._errors import ReplicaMismatchError, SpecError
from fshard._exec import body as _body
from fshard._exec.collective import collective
from fshard._exec.readonly import wrote_into
from fshard._exec.replicas import check_leaves
from fshard._layout.layout import Layout
from fshard._layout.placement import Placement
from fshard._layout.precision import check_precision
from fshard._layout.specs import Chunk, Partial, Replicated

__all__ = ["apply_module"]


@collective("apply_module")
def apply_module(
    module: torch.nn.Module,
    params: Mapping[str, ShardedArray],
    buffers: Mapping[str, ShardedArray],
    *args: Any,
    out_specs: Any = None,
    method: Callable[..., Any] | None = None,
    rules: Any = None,
    regather: bool = False,
    precision: Any = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, ShardedArray]]:
    """Runs ``module`` on sharded parameters and inputs: ``(out, new_buffers)``; the module is not changed.

    The arrays among ``args`` and ``kwargs`` (a per-rank batch: ``fshard.from_local_tensor``,
    or ``Chunk(0)``) say where the module runs: once per placement of the first one, on that
    placement's blocks. Tensors are whole on every placement; other values are passed as they
    are. The parameters and buffers move as one tree to ``Replicated`` on those placements
    (a fully-sharded program gathers them here, and its backward reduce-scatters their
    gradients; a replicated one moves nothing and all-reduces them). The module runs as a
    functional clone holding the placement's blocks, so ``torch.utils.checkpoint`` with
    ``use_reentrant=False`` inside the forward recomputes with the same tensors
    (``use_reentrant=True`` there is refused; around the whole call either works); tied
    parameters are one array used in every place.

    Buffers that the forward updates, in place or by assigning a new tensor (BatchNorm's
    running statistics, a flag set at the first batch), come back in ``new_buffers``: each
    placement updates its own copy from its own rows, and each element of the result is the
    value the placements hold where they all hold one (an element left as it was, or one that
    every placement writes alike: exactly that value, infinities included), else the mean of
    their values (integers and bools rounded down: a counter advances by the mean of the
    placements' steps, a bool is ``True`` where every placement holds ``True``), the same on
    every rank: data parallelism without SyncBatchNorm, with the running statistics averaged
    over the ranks. Only the persistent buffers of real or bool dtype of submodules in
    training mode may change (they take part in one reduction per call, so register
    constants with ``persistent=False``); the others are read-only, come back as the arrays
    passed in, and a forward that writes into one or assigns another tensor to it raises.

    Args:
        module: the ``torch.nn.Module`` whose structure (and code) runs.
        params: names to arrays, from ``fshard.shard_module`` (or ``fshard.load`` of them).
        buffers: names to arrays, as ``params``.
        args: the forward's arguments.
        out_specs: the result's spec(s): one for every tensor of the result, or a pytree matching
            it; ``fshard.Partial(...)`` for a loss summed over placements. Default: ``Chunk(0)``
            over the placements when the first array argument is laid out that way,
            ``Replicated`` when it is replicated.
        method: runs ``method(clone, *args, **kwargs)`` instead of the forward (a loss of the
            module's output, say).
        rules: the rules ``params`` were sharded with. Tensor-parallel ones
            (``fshard.tensor_parallel``) give each parameter its block inside the body instead
            of the whole tensor, and sum the row-parallel Linears' products over their axis;
            the default result spec is then ``rules.rows``. Other rules change nothing.
        regather: the gathered parameters are not kept for the backward, which gathers them
            again (``fshard.shard_map``'s ``regather``): apply each block of a fully-sharded
            model with it, and the peak holds about one block's full weights.
        precision: an ``fshard.Precision`` for the floating parameters (FSDP2's
            ``MixedPrecisionPolicy``): each moves to the body in its ``param`` dtype, and its
            gradient is moved and summed in its ``reduce`` dtype, then returned in the parameter's
            own dtype (``fshard.shard_map``'s ``precision``). Buffers and the inputs are left as
            they are: give inputs that the module can take with parameters of that dtype (a
            BatchNorm's fp32 running statistics cannot take bf16 weights).
        kwargs: the forward's keyword arguments. ``out_specs``, ``method``, ``rules``, ``regather``
            and ``precision`` are ``apply_module``'s own: pass a forward keyword of one of those
            names through ``method`` (``method=lambda m, x: m(x, precision=...)``).

    Returns:
        The result as arrays laid out by ``out_specs``, and the buffers after the forward.

    Raises:
        SpecError: a parameter or buffer of the module is missing from ``params``/``buffers``,
            the default ``out_specs`` does not apply, tensor-parallel ``rules`` that do not fit
            the module or its placements (or a reshape that fixes the head count), values would
            have to come off the meta device, the forward assigns to a read-only buffer or
            gives an updated one another shape or dtype, or the checks of ``fshard.shard_map``.
        TypeError: ``module`` is not a module, or ``method`` is neither ``None`` nor callable.

    >>> import torch, fshard
    >>> torch.manual_seed(0) and None
    >>> model, ranks = torch.nn.Linear(4, 2), [0, 1]
    >>> params, buffers = fshard.shard_module(model, fshard.fully_sharded(ranks))
    >>> x = torch.randn(6, 4)
    >>> out, _ = fshard.apply_module(model, params, buffers, fshard.shard(x, fshard.Chunk(0, ranks)))
    >>> torch.allclose(fshard.gather(out), model(x))
    True
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"apply_module() takes a torch.nn.Module, got {type(module).__name__}.")
    if method is not None and not callable(method):
        msg = (
            f"apply_module() method must be None (the module's forward) or a function (clone, *args, **kwargs), "
            f"got {type(method).__name__}."
        )
        raise TypeError(msg)
    found = structure(module)
    _check_names("params", params, found.params, found.shapes, module)
    _check_names("buffers", buffers, found.buffers, found.shapes, module)
    pnames, bnames, keys = list(found.params), list(found.buffers), list(kwargs)
    inputs = [*args, *kwargs.values()]
    placements = _placements(inputs, params)
    _check_meta(placements, params, buffers, found.updated)
    everywhere = Replicated(placements)
    tp = _tensor_parallel(rules, module, placements)
    no_rows: Mapping[int, str] = {}
    param_specs, rows = ([everywhere] * len(pnames), no_rows) if tp is None else _tp_plan(tp, module, found)
    in_specs = [*param_specs, *([everywhere] * len(bnames)), *(_in_spec(v, everywhere) for v in inputs)]
    mixed = check_precision(precision, "apply_module()")
    precisions = [mixed if params[n].dtype.is_floating_point else None for n in pnames]
    precisions += [None] * (len(in_specs) - len(pnames))
    updated = found.updated
    n_args = len(args)
    kept: dict[Placement, dict[str, torch.Tensor]] = {}  # each placement's values of the updated buffers

    def body(*blocks: Any) -> Any:
        ps = dict(zip(pnames, blocks))
        bs = dict(zip(bnames, blocks[len(pnames) : len(pnames) + len(bnames)]))
        olds = {name: bs[name] for name in updated}
        bs.update({name: t.clone() for name, t in olds.items()})
        memo: dict[int, torch.nn.Module] = {}
        clone = clone_tree(module, found, ps, bs, memo, torch.is_grad_enabled(), rows)
        rest = blocks[len(pnames) + len(bnames) :]
        call_args, call_kwargs = rest[:n_args], dict(zip(keys, rest[n_args:]))
        try:
            with _local_heads_hint(tp):
                out = clone(*call_args, **call_kwargs) if method is None else method(clone, *call_args, **call_kwargs)
        except SpecError as error:  # a write into a read-only buffer: named, with its own fix
            name = next((n for n in found.read_only if wrote_into(error, bs[n])), None)
            if name is None:
                raise
            raise SpecError(_replaced_message(found, memo, name, bs[name].dtype, "wrote in place into")) from None
        if out_specs is not None and not torch.compiler.is_compiling():  # named as the caller wrote it
            check_out_specs(out_specs, out, "apply_module()", "the module")
        _keep(kept, found, memo, bs, olds)
        return out

    first = next((v for v in inputs if isinstance(v, ShardedArray)), None)
    # Under tensor parallelism a result is whole along tp because psum made it so, which the
    # replication check cannot see; check mode still compares the copies' contents.
    run = named_shard_map(
        compiled_where_called(body),  # as shard_map's fn: compiled where apply_module's caller is
        in_specs=tuple(in_specs),
        out_specs=_default_out_specs(first, placements, tp) if out_specs is None else out_specs,
        check_vma=tp is None,
        regather=regather,
        precision=precisions,
        what="apply_module()",
        labels=_labels(found.params, found.buffers, n_args, tuple(keys)),
        reducing_key=(body.__code__, tp, getattr(method, "__code__", None)),  # not threaded for another plan's psum
        form=(_UPDATES, repr(list(updated))),  # every rank then moves the same buffers after the call
    )
    out = run(*(params[n] for n in pnames), *(buffers[n] for n in bnames), *inputs)
    if tp is not None and not torch.compiler.is_compiling():
        key = (found, tp, getattr(method, "__code__", method))  # a method's code: a lambda made anew counts once
        if not _passed(module, key):
            _check_tp_results(out)
            _TP_CHECKED[module] = key  # passed: not compared again
    return out, _updated_buffers(buffers, updated, kept, placements)


# What the ranks of an apply_module call must agree on: which buffers its forward updates.
_UPDATES = (
    "the buffers the module's forward updates, which each submodule's train() or eval() mode decides (a "
    "BatchNorm in train() mode updates its running statistics): call model.train() or model.eval() alike on "
    "every rank"
)


# Per module: the structure, rules and method whose results were compared once across their tp copies.
_TP_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Structure, TensorParallel, Any]] = (
    weakref.WeakKeyDictionary()
)


def _passed(module: torch.nn.Module, key: tuple[Structure, TensorParallel, Any]) -> bool:
    """Whether a call of ``module`` with this structure, these rules and this method passed the check.

    Every rank makes the same calls, so every rank answers alike.
    """
    seen = _TP_CHECKED.get(module)
    return seen is not None and seen[0] is key[0] and seen[1] == key[1] and seen[2] is key[2]


@opaque  # a comparison of the copies' digests: eagerly
def _check_tp_results(out: Any) -> None:
    """Compares the tp copies of each result once, as check mode does at every call.

    A result is whole along tp where the row-parallel Linears summed it, which the layouts cannot
    show: a plan that reads a column-parallel output any other way (a head planned ``"colwise"``,
    ``q(h).sum(-1)``, ``F.linear(x, self.down.weight)`` called directly) leaves each placement its
    own share. The first call of each module, rules and method compares the copies; a plan that
    is wrong there raises on every rank rather than train on one placement's share.
    """
    leaves = [x for x in optree.tree_leaves(out, is_leaf=_is_array) if isinstance(x, ShardedArray)]
    try:
        check_leaves([(f"result {n} of apply_module()", a) for n, a in enumerate(leaves)], "apply_module()")
    except ReplicaMismatchError as error:
        msg = (
            "apply_module() under tensor parallelism: its result differs between the tp placements, where the "
            "rules make it whole along tp. A column-parallel output (a \"colwise\" Linear's) is a placement's share "
            'of the features, and becomes whole only as the input of a "rowwise" Linear\'s own forward, which sums '
            "it over tp. Plan the layers whose output is read otherwise (a head, a sum over features, a weight "
            "passed to F.linear directly) as neither (whole on every placement), or follow them with a rowwise "
            "Linear. Random draws differ too where the ranks' generators stand apart (seeded per rank): seed "
            "them alike, or give such a module its random numbers as an argument (fshard.rand). The copies "
            "compared: "
            f"{error}"
        )
        raise ReplicaMismatchError(msg) from None


def _is_array(x: Any) -> bool:
    return isinstance(x, ShardedArray)


@cached(64)
def _labels(params: tuple[str, ...], buffers: tuple[str, ...], n_args: int, keys: tuple[str, ...]) -> tuple[str, ...]:
    """How errors name each argument of ``apply_module``'s ``shard_map``: as the caller passed it."""
    return (
        *(f"parameter {n!r}" for n in params),
        *(f"buffer {n!r}" for n in buffers),
        *(f"forward argument {k}" for k in range(n_args)),
        *(f"forward keyword {k!r}" for k in keys),
    )


def _tensor_parallel(rules: Any, module: torch.nn.Module, placements: Sequence[Placement]) -> TensorParallel | None:
    """``rules`` when they are tensor-parallel and fit where the module runs; ``None`` for other rules."""
    if not isinstance(rules, TensorParallel):
        return None
    if set(rules.mesh.ranks) != set(placements):
        msg = (
            f"apply_module() rules are tensor-parallel on a mesh of {[str(p) for p in rules.mesh.ranks]}, but the "
            f"module runs on {[str(p) for p in placements]} (the first array argument's placements): shard the "
            "inputs over the mesh, e.g. fshard.shard(x, rules.rows)."
        )
        raise SpecError(msg)
    return rules


_TP: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Structure, TensorParallel, list[Any], Mapping[int, str]]] = (
    weakref.WeakKeyDictionary()
)


def _tp_plan(tp: TensorParallel, module: torch.nn.Module, found: Structure) -> tuple[list[Any], Mapping[int, str]]:
    """The parameters' body specs and ``tp.check(module)``, cached while the module and the rules stay the same."""
    hit = _TP.get(module)
    if hit is not None and hit[0] is found and hit[1] == tp:
        return hit[2], hit[3]
    rows = tp.check(module)
    specs = [tp.body_spec(n) for n in found.params]
    _TP[module] = (found, tp, specs, rows)
    return specs, rows


@contextlib.contextmanager
def _local_heads_hint(tp: TensorParallel | None) -> Generator[None, None, None]:
    """Names the likely cause when a reshape fails on a placement's share of a column-parallel output."""
    try:
        yield
    except RuntimeError as exc:
        if tp is None or "is invalid for input of size" not in str(exc):
            raise
        msg = (
            f"apply_module(): a reshape failed on a placement's block ({exc}). Under tensor parallelism a "
            f"column-parallel Linear gives each placement 1/{tp.mesh.shape[tp.mesh.axis_names.index(tp.tp)]} of "
            "its output features (its share of the attention heads): reshape with -1 heads "
            "(x.view(b, t, -1, head_dim)), not a fixed head count, and split a number of heads that tp divides."
        )
        raise SpecError(msg) from exc


def _check_names(
    what: str, given: Mapping[str, Any], names: Sequence[str], shapes: Mapping[str, tuple[int, ...]], module: Any
) -> None:
    """Refuses ``given`` (``params`` or ``buffers``) unless it holds an array of the module's shape for each name."""
    if not isinstance(given, Mapping):
        raise TypeError(f"apply_module() {what} must be a mapping of names to arrays, got {type(given).__name__}.")
    missing = [n for n in names if n not in given]
    known = set(names)
    extra = [n for n in given if n not in known]
    if missing or extra:
        msg = (
            f"apply_module() {what} do not fit the module: missing {missing[:5]}, "
            f"unexpected {extra[:5]}. Build them with fshard.shard_module(module, rules) (a tied parameter is "
            "one entry, under its first name)."
        )
        raise SpecError(msg)
    bad = next((n for n in names if not isinstance(given[n], ShardedArray)), None)
    if bad is not None:
        raise SpecError(f"apply_module() {what}[{bad!r}] is a {type(given[bad]).__name__}, not a ShardedArray.")
    bad = next((n for n in names if given[n].shape != shapes[n]), None)  # a torch.Size equals its tuple
    if bad is not None:
        msg = (
            f"apply_module() {what}[{bad!r}] has shape {tuple(given[bad].shape)}, where the "
            f"{type(module).__name__}'s {'parameter' if what == 'params' else 'buffer'} {bad!r} has shape "
            f"{shapes[bad]}: pass the arrays that fshard.shard_module made of this module (or arrays of its shapes)."
        )
        raise SpecError(msg)


def _placements(inputs: Sequence[Any], params: Mapping[str, ShardedArray]) -> list[Placement]:
    """Where the module runs: the placements of the first array argument, else of the first parameter."""
    first = next((v for v in inputs if isinstance(v, ShardedArray)), None)
    first = next(iter(params.values()), None) if first is None else first
    if first is None:
        raise SpecError("apply_module() needs an array among the arguments or the parameters to know where to run.")
    return list(dict.fromkeys(s.placement for s in first.layout.shards))


def _check_meta(
    placements: Sequence[Placement],
    params: Mapping[str, ShardedArray],
    buffers: Mapping[str, ShardedArray],
    updated: Sequence[str],
) -> None:
    """Refuses runs whose values would have to come off the meta device, which holds none."""
    on_meta = [p.device == "meta" for p in placements]
    if not all(on_meta):
        empty = next((n for n, a in (*params.items(), *buffers.items()) if a.device.type == "meta"), None)
        if empty is not None:
            msg = (
                f"apply_module() runs on {[str(p) for p in placements][:4]} (the first array argument's placements) "
                f"but {empty!r} is on the meta device, which holds no values to move there: shard the module's "
                "real tensors, or pass arguments on the meta device too."
            )
            raise SpecError(msg)
    if any(on_meta):
        held = next((n for n in updated if buffers[n].device.type != "meta"), None)
        if held is not None:
            msg = (
                f"apply_module() runs on the meta device (the first array argument's placements) but buffer "
                f"{held!r}, which the forward updates, holds values on {buffers[held].device}: its update cannot "
                "come back from the meta device. Pass arguments on the buffers' devices, or put the module in "
                "eval mode."
            )
            raise SpecError(msg)


def _in_spec(value: Any, everywhere: Replicated) -> Any:
    if isinstance(value, ShardedArray):
        return value.layout
    return everywhere if isinstance(value, torch.Tensor) else None


def _default_out_specs(first: ShardedArray | None, placements: list[Placement], tp: TensorParallel | None) -> Any:
    if first is not None and first.layout.partial is not None:  # refused with the arguments, whose error says why
        return Replicated(placements)
    if tp is not None and first is not None and first.layout == tp.rows.layout(first.shape):
        return tp.rows
    if first is None or first.layout == Replicated(placements).layout(first.shape):
        return Replicated(placements)
    if first.ndim and first.layout == Chunk(0, placements).layout(first.shape):
        return Chunk(0, placements)
    msg = (
        f"apply_module() cannot choose the result's layout from the first array argument's ({first.layout!r}): "
        "pass out_specs= (e.g. fshard.Partial(fshard.Replicated(ranks)) for a loss summed over the placements)."
    )
    raise SpecError(msg)


def _held(found: Structure, memo: Mapping[int, torch.nn.Module], name: str) -> Any:
    """What buffer ``name``'s place in the clone holds after the forward (``None`` where it was deleted)."""
    owner, local = found.homes[name]
    return vars(memo[owner])["_buffers"].get(local)


@opaque  # reads the running body and the clone's modules: eagerly, at a graph break under torch.compile
def _keep(
    kept: dict[Placement, dict[str, torch.Tensor]],
    found: Structure,
    memo: Mapping[int, torch.nn.Module],
    given: Mapping[str, torch.Tensor],
    olds: Mapping[str, torch.Tensor],
) -> None:
    """Files the running placement's values of the updated buffers in ``kept``; refuses replaced read-only ones.

    ``given`` holds the tensors the clone was made with, ``olds`` the updated buffers' blocks.
    """
    for name in found.read_only:
        if _held(found, memo, name) is not given[name]:
            raise SpecError(_replaced_message(found, memo, name, given[name].dtype))
    _check_aliases(found, memo)
    here = _body.current()
    assert here is not None, "apply_module's body runs inside its shard_map"
    values = {name: _checked_value(name, _held(found, memo, name), old) for name, old in olds.items()}
    kept[here.placements[here.index]] = values


def _check_aliases(found: Structure, memo: Mapping[int, torch.nn.Module]) -> None:
    """Refuses a buffer that the forward replaced under another name than its first (a tied buffer's alias).

    Its first name's place is what comes back (``_held``): a new value in another place of the
    same tensor would be lost.
    """
    for owner, (_, buffers) in found.slots.items():
        clone = memo.get(owner)
        if clone is None or not buffers:
            continue
        held = vars(clone)["_buffers"]
        for local, name in buffers:
            if found.homes.get(name) != (owner, local) and held.get(local) is not _held(found, memo, name):
                alias = next((a for a, n in found.ties if n == name and a.rpartition(".")[2] == local), local)
                msg = (
                    f"apply_module(): the forward replaced buffer {alias!r}, the same tensor as buffer {name!r}: "
                    f"only {name!r} comes back in new_buffers, so the new value would be lost. Assign it through "
                    f"{name!r} (or update it in place), or register two buffers."
                )
                raise SpecError(msg)


def _replaced_message(
    found: Structure, memo: Mapping[int, torch.nn.Module], name: str, dtype: torch.dtype, how: str = "replaced"
) -> str:
    """Why buffer ``name`` is read-only (the forward ``how`` it: replaced it, or wrote into it), and the fix."""
    owner, local = found.homes[name]
    module = memo[owner]
    if local in vars(module)["_non_persistent_buffers_set"]:
        why = "a non-persistent buffer"
        fix = f"register it with persistent=True (register_buffer({local!r}, tensor, persistent=True))"
    elif not module.training:
        why = f"a buffer of a submodule in eval mode ({type(module).__name__})"
        fix = "put the submodule in training mode (module.train()) for the calls that update it"
    else:
        why = f"a {dtype} buffer, which has no mean over the placements"
        fix = "keep it in a real or bool dtype (torch.view_as_real for a complex one)"
    return (
        f"apply_module(): the forward {how} buffer {name!r}, {why}: only the persistent buffers of submodules "
        f"in training mode come back in new_buffers, the others are read-only, so the new value would be lost. "
        f"For its update to come back, {fix}; or leave the buffer as it is."
    )


def _checked_value(name: str, new: Any, old: torch.Tensor) -> torch.Tensor:
    """Buffer ``name``'s value after the forward, on ``old``'s device, as the combination sums it.

    Raises:
        SpecError: the forward deleted it or gave it another shape or dtype than ``old``'s.
    """
    if not isinstance(new, torch.Tensor) or new.shape != old.shape or new.dtype != old.dtype:
        got = "nothing" if new is None else f"shape {tuple(new.shape)}, {new.dtype}"
        msg = (
            f"apply_module(): the forward left buffer {name!r} holding {got}, in place of shape "
            f"{tuple(old.shape)}, {old.dtype}: new_buffers keeps each buffer's shape and dtype. Update it in "
            f"place (self.{name.rsplit('.', 1)[-1]}.copy_(value)) or assign a tensor of its shape and dtype."
        )
        raise SpecError(msg)
    return new.detach().to(old.device, _wire(old.dtype))


def _wire(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a buffer's values are combined: ``float64`` if floating (each exactly), else ``int64``."""
    return torch.float64 if dtype.is_floating_point else torch.int64


def _updated_buffers(
    buffers: Mapping[str, ShardedArray],
    updated: Sequence[str],
    kept: Mapping[Placement, Mapping[str, torch.Tensor]],
    placements: Sequence[Placement],
) -> dict[str, ShardedArray]:
    """The buffers, the updated ones combined over the placements (``_combined``): one movement for the whole tree.

    Each placement's value of each updated buffer is pending three times, as a summand and
    as a candidate for the largest and the smallest value.
    """
    out = dict(buffers)
    if not updated:
        return out
    parts = [_pending(buffers[k], k, kept, tuple(placements), op) for op in _OPS for k in updated]
    reduced = cast("list[ShardedArray]", reshard(parts, [buffers[k].layout for _ in _OPS for k in updated]))
    n = len(updated)
    for k, name in enumerate(updated):
        total, hi, lo = (reduced[j * n + k].addressable_data for j in range(len(_OPS)))
        data = [_combined(*values, n=len(placements), dtype=buffers[name].dtype) for values in zip(total, hi, lo)]
        out[name] = ShardedArray(buffers[name].layout, data, buffers[name].backend, buffers[name].dtype)
    return out


_OPS = ("sum", "max", "min")


def _pending(
    buffer: ShardedArray,
    name: str,
    kept: Mapping[Placement, Mapping[str, torch.Tensor]],
    placements: tuple[Placement, ...],
    op: str,
) -> ShardedArray:
    """The placements' values of buffer ``name`` as a pending ``op`` over them, from those this process holds.

    A floating value is a summand divided by the number of placements: the sum is then their
    mean, with no total that could overflow on the way.
    """
    layout = _pending_layout(placements, op, buffer.shape)
    held: Sequence[int] = buffer.backend.addressable(layout)
    data = tuple(kept[layout.shards[i].placement][name] for i in held)
    if op == "sum" and buffer.dtype.is_floating_point:
        data = tuple(t / len(placements) for t in data)
    return ShardedArray(layout, data, buffer.backend, _wire(buffer.dtype))


@cached(256)
def _pending_layout(placements: tuple[Placement, ...], op: str, shape: tuple[int, ...]) -> Layout:
    """``Partial(Replicated(placements), op)``'s layout of ``shape``: made once, not per buffer and call."""
    return Partial(Replicated(placements), op).layout(shape)


def _combined(total: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Where the ``n`` placements hold one value, that value; elsewhere their mean (``total``; integers: floored)."""
    mean = total if total.is_floating_point() else torch.div(total, n, rounding_mode="floor")
    return torch.where(hi == lo, hi, mean).to(dtype)
