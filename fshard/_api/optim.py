"""Optimizer state as a tree of arrays: ``optimizer_state`` and ``load_optimizer_state``.

A torch optimizer over the shard tensors of a tree of arrays (``optree.tree_leaves(params)``)
keeps, per shard tensor, state of the shard's shape (AdamW's ``exp_avg`` and ``exp_avg_sq``,
SGD's ``momentum_buffer``) and scalars (``step``). Taken array by array, the first are
arrays with the parameters' layouts, which ``fshard.save`` writes and ``fshard.load(like=...)``
reads onto any layout and world size; the scalars are one value per array, the same on
every shard of it. ``step`` is a scalar even where the shard is one too (a 0-d parameter,
CLIP's ``logit_scale``), and keeps its own dtype on loading, as ``Optimizer.load_state_dict``
keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import optree
import torch

from fshard._api.map_trees import path_text
from fshard._array.array import ShardedArray
from fshard._errors import SpecError
from fshard._exec.accumulate import step_unchecked
from fshard._exec.collective import collective
from fshard._exec.replicas import check_global

__all__ = ["load_optimizer_state", "optimizer_state"]

Leaf = ShardedArray | torch.Tensor

# The state key that torch's optimizers count steps in: a scalar whatever the parameter's shape,
# which Optimizer.load_state_dict never casts to the parameter's dtype (a bf16 count stops at 256).
_STEP = "step"


@collective("optimizer_state")
def optimizer_state(opt: torch.optim.Optimizer, params: Any) -> dict[str, Any]:
    """The state of ``opt``, an optimizer over the leaves of ``params``, as a tree of arrays.

    For each state key, a tree shaped like ``params``: an array in its parameter's layout
    where the state has the shard's shape (``exp_avg``), else the one value that every shard
    of the parameter holds (``step``, whatever the parameter's shape), or ``None`` for a
    parameter that has no state (a frozen one, or one no step has had a gradient for yet:
    as ``Optimizer.state_dict`` leaves it out). The arrays share the optimizer's tensors:
    save them before its next step. An optimizer that has not stepped has no state yet: it
    is made the way ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
    makes it (one step on zero gradients with the learning rate at 0, which leaves the
    parameters as they are), which is what a ``like=`` for loading needs. That state stays the
    optimizer's (AdamW has counted a step; SGD's momentum holds the weight decay term), so its
    next steps differ slightly from those of an optimizer never asked, as with torch's.

    Args:
        opt: a ``torch.optim.Optimizer`` whose parameters are the leaves of ``params``.
        params: a tree of ``ShardedArray`` (and plain tensor) parameters; a ``None`` in it is a
            parameter that is not there (a layer without a bias), ``None`` in every state tree too.

    Returns:
        ``{"state": {key: tree like params}, "param_groups": [...]}``; each group holds its
        hyperparameters (``lr``, ``betas``, ...) and ``"arrays"``, the paths of its parameters
        in ``params`` (``optree`` path strings).

    Raises:
        TypeError: ``opt`` is not a ``torch.optim.Optimizer``, or a leaf of ``params`` is not
            an array or a tensor.
        SpecError: a leaf of ``params`` is not a parameter of ``opt`` (or the other way
            round), an array's shards sit in different groups, or the shards of one array
            hold different scalars or different state keys (some none).
        CollectiveMismatchError: in check mode, ranks hold different scalars for an array.

    >>> import optree, torch, fshard
    >>> params = {"w": fshard.shard(torch.ones(4, 2), fshard.Chunk(0, [0, 1]))}
    >>> opt = torch.optim.AdamW([t.requires_grad_() for t in optree.tree_leaves(params)], lr=0.1)
    >>> fshard.gather(params["w"]).sum().backward()
    >>> opt.step()
    >>> state = fshard.optimizer_state(opt, params)
    >>> sorted(state["state"]), state["state"]["exp_avg"]["w"].layout == params["w"].layout
    (['exp_avg', 'exp_avg_sq', 'step'], True)
    >>> state["state"]["step"]["w"], state["param_groups"][0]["lr"], state["param_groups"][0]["arrays"]
    (tensor(1.), 0.1, ["['w']"])
    """
    _check_optimizer("optimizer_state", opt)
    arrays, treespec, paths = _flatten(params)
    groups = _groups(opt, arrays, paths)
    if not opt.state:
        _init_state(opt)
    keys = sorted({k for a in arrays for t in _own(a) for k in opt.state.get(t, {})})
    state: dict[str, Any] = {}
    scalars: list[tuple[str, torch.Tensor]] = []
    for key in keys:
        values = [_value(opt, a, key, path) for a, path in zip(arrays, paths)]
        scalars += [
            (f"{key!r} of {p}", torch.as_tensor(v)) for p, v in zip(paths, values) if v is not None and not _is_array(v)
        ]
        state[key] = optree.tree_unflatten(treespec, values)
    backend = next((a.backend for a in arrays if isinstance(a, ShardedArray)), None)
    if scalars and backend is not None:
        check_global(backend, scalars)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    for n, h in enumerate(hyper):
        h["arrays"] = [p for p, g in zip(paths, groups) if g == n]
    return {"state": state, "param_groups": hyper}


@collective("load_optimizer_state")
def load_optimizer_state(opt: torch.optim.Optimizer, params: Any, state: Any) -> None:
    """Puts ``state`` (from ``optimizer_state``, on any world size) into ``opt``, an optimizer over ``params``.

    Load ``state`` with ``fshard.load(path, like=fshard.optimizer_state(opt, params))``: its
    arrays then have the layouts of ``params``. Each shard tensor gets its part of every array
    (cast to the parameter's dtype and device where floating point, as
    ``Optimizer.load_state_dict`` does) and its own copy of every scalar (``step`` in the dtype
    it was saved in, as there); each parameter group gets the saved hyperparameters (set
    ``lr`` after this call to change it).

    Args:
        opt: a ``torch.optim.Optimizer`` whose parameters are the leaves of ``params``, in
            as many groups as were saved, each with the same parameters (by path).
        params: the tree of arrays that ``opt`` optimizes.
        state: the tree that ``optimizer_state`` returned (saved and loaded).

    Raises:
        TypeError: ``opt`` is not a ``torch.optim.Optimizer``, or a leaf of ``params`` is not
            an array or a tensor.
        SpecError: ``state`` does not fit ``opt`` and ``params``: other tree structure,
            an array in another layout, other parameter groups, or a leaf of ``params``
            that ``opt`` does not optimize.

    >>> import optree, torch, fshard
    >>> params = {"w": fshard.shard(torch.ones(4, 2), fshard.Chunk(0, [0, 1]))}
    >>> opt = torch.optim.SGD([t.requires_grad_() for t in optree.tree_leaves(params)], lr=0.1, momentum=0.9)
    >>> saved = fshard.optimizer_state(opt, params)  # before the first step: momentum buffers of zeros
    >>> opt2 = torch.optim.SGD(optree.tree_leaves(params), lr=0.5, momentum=0.9)
    >>> fshard.load_optimizer_state(opt2, params, saved)
    >>> opt2.param_groups[0]["lr"], opt2.state[params["w"].addressable_data[1]]["momentum_buffer"].shape
    (0.1, torch.Size([2, 2]))
    """
    _check_optimizer("load_optimizer_state", opt)
    arrays, treespec, paths = _flatten(params)
    groups = _groups(opt, arrays, paths)
    saved = _check_groups(state, len(opt.param_groups), groups, paths)
    puts: list[tuple[Leaf, Any, str, str]] = []  # every value checked before any is put: a refusal changes nothing
    for key, tree in cast("dict[str, Any]", state["state"]).items():
        values: list[Any] = []
        try:  # one value per parameter (None: it had none), and None where params has None
            values, why = list(treespec.flatten_up_to(tree)), ""
        except ValueError as exc:
            why = f" ({exc})"
        if why or any(v is not None and not _is_leaf(v) for v in values):
            spec = optree.tree_structure(tree, is_leaf=_is_array)
            msg = (
                f"load_optimizer_state() state {key!r} is a tree of another structure than params: {spec} against "
                f"{treespec}{why}. Load it with like=fshard.optimizer_state(opt, params)."
            )
            raise SpecError(msg)
        for a, v, path in zip(arrays, values, paths):
            _check_fits(a, v, key, path)
            puts.append((a, v, key, path))
    for a, v, key, path in puts:
        _put(opt, a, v, key, path)
    for group, hyper in zip(opt.param_groups, saved):
        group.update({k: v for k, v in hyper.items() if k != "arrays"})


# -- the leaves ------------------------------------------------------------------------------


def _check_optimizer(what: str, opt: Any) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        msg = (
            f"{what}() opt must be a torch.optim.Optimizer over the shard tensors of params "
            f"(torch.optim.AdamW(optree.tree_leaves(params))), got {type(opt).__name__}."
        )
        raise TypeError(msg)


def _is_array(x: Any) -> bool:
    return isinstance(x, ShardedArray)


def _is_leaf(x: Any) -> bool:
    """Whether ``x`` is one state value (an array, a tensor, a number), not a container of them."""
    return optree.treespec_is_leaf(optree.tree_structure(x, is_leaf=_is_array))


def _flatten(params: Any) -> tuple[list[Leaf], Any, list[str]]:
    """The arrays (and plain tensors) of ``params``, its structure over them, and their paths.

    A ``None`` in ``params`` is a parameter that is not there (a layer without a bias): it stays
    ``None`` in the state's trees.
    """
    leaves, treespec = optree.tree_flatten(params, is_leaf=_is_array)
    paths = [path_text(p) for p in optree.tree_paths(params, is_leaf=_is_array)]
    for leaf, path in zip(leaves, paths):
        if not isinstance(leaf, (ShardedArray, torch.Tensor)):
            msg = f"params{path} is a {type(leaf).__name__}: give a tree of ShardedArrays and tensors."
            raise TypeError(msg)
    return cast("list[Leaf]", leaves), treespec, paths


def _own(a: Leaf) -> list[torch.Tensor]:
    """The tensors of ``a`` that users hand to the optimizer: ``optree.tree_leaves(a)``."""
    tree: Any = a  # a pytree node (optree's PyTree type does not name registered classes)
    return [a] if isinstance(a, torch.Tensor) else cast("list[torch.Tensor]", optree.tree_leaves(tree))


def _groups(opt: torch.optim.Optimizer, arrays: Sequence[Leaf], paths: Sequence[str]) -> list[int]:
    """The parameter group of each array.

    Raises:
        SpecError: a leaf that ``opt`` does not optimize, an optimizer parameter that is no
            leaf, or an array whose shards sit in different groups.
    """
    group_of = {id(p): n for n, g in enumerate(opt.param_groups) for p in g["params"]}
    first: dict[int, str] = {}
    for a, path in zip(arrays, paths):
        for t in _own(a):
            other = first.setdefault(id(t), path)
            if other != path:
                msg = (
                    f"params{other} and params{path} are one array (a weight tied across stages): its state is "
                    f"one. Give a tree that holds each array once (leave out params{path})."
                )
                raise SpecError(msg)
    out: list[int] = []
    for a, path in zip(arrays, paths):
        found = {group_of.get(id(t)) for t in _own(a)}
        if None in found:
            msg = (
                f"params{path} has a shard tensor that the optimizer does not optimize: build it over "
                "optree.tree_leaves(params), the shard tensors of the same arrays."
            )
            raise SpecError(msg)
        if len(found) > 1:
            msg = (
                f"params{path} has shard tensors in parameter groups {sorted(cast(set[int], found))}: put them in one."
            )
            raise SpecError(msg)
        out.append(cast(int, found.pop()))
    if sum(len(_own(a)) for a in arrays) != len(group_of):
        msg = (
            f"The optimizer has {len(group_of)} parameters but params has "
            f"{sum(len(_own(a)) for a in arrays)} leaves: give the tree whose leaves it optimizes, all of them."
        )
        raise SpecError(msg)
    return out


def _init_state(opt: torch.optim.Optimizer) -> None:
    """Makes the state of an optimizer that has not stepped, leaving its parameters as they are."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):  # a stateless optimizer (SGD without momentum) that has stepped
        return
    with torch.no_grad():
        for p in params:
            if p.requires_grad:  # a frozen parameter gets no state, as from any step
                p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in opt.param_groups]
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        with step_unchecked():  # changes nothing: gradients kept aside by no_sync stay for the syncing backward
            try:
                opt.step()
            except TypeError as exc:  # a step that needs a closure (LBFGS): its state is its group's, not per element
                msg = (
                    f"optimizer_state() cannot make the state of a {type(opt).__name__} that has not stepped "
                    f"({exc}): its step needs a closure, and it keeps the state of a whole group on one tensor, "
                    "which no layout can split. Use an optimizer whose state is per element (AdamW, SGD, ...)."
                )
                raise SpecError(msg) from exc
            except ZeroDivisionError as exc:  # a step that divides by a parameter's size (Adafactor), on an empty shard
                for p in params:  # the state the failed step made for some parameters goes: none had any
                    opt.state.pop(p, None)
                empty = [tuple(p.shape) for p in params if p.numel() == 0]
                msg = (
                    f"optimizer_state() cannot make the state of {type(opt).__name__}, which has not stepped: its "
                    f"step divides by a parameter's size ({exc}), and shards of shapes {empty} are empty. An "
                    "optimizer whose step does so keeps state per parameter, not per element (a factored second "
                    "moment, as torch.optim.Adafactor keeps), which no layout can split: use one whose state is "
                    "per element (AdamW, SGD, ...)."
                )
                raise SpecError(msg) from exc
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        opt.zero_grad(set_to_none=True)


# -- one array's state -------------------------------------------------------------------------


def _value(opt: torch.optim.Optimizer, a: Leaf, key: str, path: str) -> Any:
    """The ``key`` state of array ``a``: an array of its layout, or its shards' one scalar (``step`` always)."""
    own = _own(a)
    values = [opt.state.get(t, {}).get(key) for t in own]
    if all(v is None for v in values):  # a frozen parameter, or one no step has had a gradient for yet
        return None
    if any(v is None for v in values):
        msg = (
            f"params{path} has {key!r} state on some of its shards and none on others: its shards were "
            "stepped apart (give the optimizer every shard, and step them together), or the optimizer keeps the "
            "state of a whole group on one of its tensors (torch.optim.LBFGS), which no layout can split."
        )
        raise SpecError(msg)
    odd = next(((v, t) for v, t in zip(values, own) if isinstance(v, torch.Tensor) and v.ndim), None)
    if odd is not None and (key == _STEP or any(v.shape != t.shape for v, t in zip(values, own))):
        raise _unsplittable(opt, key, path, f"{key!r} state of shape {tuple(odd[0].shape)} on a shard of shape "
                            f"{tuple(odd[1].shape)}")  # fmt: skip
    if key != _STEP and all(isinstance(v, torch.Tensor) and v.shape == t.shape for v, t in zip(values, own)):
        tensors = [cast(torch.Tensor, v).detach() for v in values]
        if isinstance(a, torch.Tensor):
            return tensors[0]
        data = tensors if a.addressable_data else []
        return ShardedArray(a.layout, data, a.backend, tensors[0].dtype)
    first = values[0]
    if not all(_same(first, v) for v in values[1:]):
        msg = f"params{path} has different {key!r} state on its shards ({values}): its shards were stepped apart."
        raise SpecError(msg)
    return first.detach() if isinstance(first, torch.Tensor) else first


def _unsplittable(opt: torch.optim.Optimizer, key: str, path: str, what: str) -> SpecError:
    return SpecError(
        f"params{path} has {what}: {type(opt).__name__} keeps state that is neither per element of its "
        "parameter nor one scalar (a factored second moment, as torch.optim.Adafactor keeps), which no layout can "
        "split. Use an optimizer whose state is per element (AdamW, SGD, ...), or save opt.state_dict() on each "
        "rank with torch and load it into the same layout."
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def _check_groups(state: Any, n: int, groups: Sequence[int], paths: Sequence[str]) -> list[dict[str, Any]]:
    """The saved hyperparameter groups, checked against the optimizer's groups.

    Raises:
        SpecError: ``state`` is not a tree from ``optimizer_state``, or its groups hold
            other parameters than the optimizer's.
    """
    if not isinstance(state, dict) or set(cast("dict[str, Any]", state)) != {"state", "param_groups"}:
        msg = "load_optimizer_state() state must be the tree that fshard.optimizer_state returned (loaded)."
        raise SpecError(msg)
    tables: Any = cast("dict[str, Any]", state)["state"]
    groups_saved: Any = cast("dict[str, Any]", state)["param_groups"]
    if not isinstance(tables, dict) or any(not isinstance(k, str) for k in cast("dict[Any, Any]", tables)):
        msg = (
            f"load_optimizer_state() state['state'] must map state keys (str) to trees like params, got "
            f"{_brief(tables)}: pass the tree that fshard.optimizer_state returned (loaded)."
        )
        raise SpecError(msg)
    if not isinstance(groups_saved, (list, tuple)) or not all(
        isinstance(g, dict) and isinstance(g.get("arrays", ()), (list, tuple))  # pyright: ignore[reportUnknownMemberType]
        for g in cast("list[Any]", groups_saved)
    ):
        msg = (
            f"load_optimizer_state() state['param_groups'] must be a list of dicts of hyperparameters, each with "
            f"its 'arrays' (a list of paths), got {_brief(groups_saved)}: pass the tree that "
            "fshard.optimizer_state returned (loaded)."
        )
        raise SpecError(msg)
    saved = cast("list[dict[str, Any]]", list(cast("list[Any]", groups_saved)))
    if len(saved) != n:
        msg = f"load_optimizer_state() state has {len(saved)} parameter groups, the optimizer {n}: build it alike."
        raise SpecError(msg)
    for k, hyper in enumerate(saved):
        mine = [p for p, g in zip(paths, groups) if g == k]
        if list(hyper.get("arrays", ())) != mine:
            msg = (
                f"load_optimizer_state() parameter group {k} held {list(hyper.get('arrays', ()))} when saved, "
                f"the optimizer's holds {mine}: group the parameters as they were."
            )
            raise SpecError(msg)
    return saved


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_fits(a: Leaf, value: Any, key: str, path: str) -> None:
    """Raises ``SpecError`` where ``value`` cannot be the ``key`` state of parameter ``a`` (``_put``'s cases)."""
    if isinstance(value, ShardedArray):
        if not isinstance(a, ShardedArray) or value.layout != a.layout:
            layout = a.layout if isinstance(a, ShardedArray) else "a plain tensor"
            msg = (
                f"load_optimizer_state() state {key!r} of params{path} has layout {value.layout}, the parameter "
                f"{layout}: load the state with like=fshard.optimizer_state(opt, params)."
            )
            raise SpecError(msg)
    elif isinstance(value, torch.Tensor) and value.ndim and (key == _STEP or value.shape != a.shape):
        msg = (
            f"load_optimizer_state() state {key!r} of params{path} is a tensor of shape {tuple(value.shape)}, "
            f"the parameter's shape is {tuple(a.shape)}: a state value is per element (of the parameter's shape) "
            "or one scalar. Load the state with like=fshard.optimizer_state(opt, params)."
        )
        raise SpecError(msg)


def _put(opt: torch.optim.Optimizer, a: Leaf, value: Any, key: str, path: str) -> None:
    """Gives each shard tensor of ``a`` its ``key`` state from ``value`` (``None``: it had none); checked first."""
    own = _own(a)
    if value is None:  # as Optimizer.load_state_dict leaves a parameter the saved state does not name
        for t in own:
            held = opt.state.get(t)
            if held is not None:
                held.pop(key, None)
                if not held:
                    del opt.state[t]
        return
    if isinstance(value, ShardedArray):
        parts = _own(value)
    elif isinstance(a, torch.Tensor) and isinstance(value, torch.Tensor) and value.shape == a.shape and key != _STEP:
        parts = [value]
    elif (
        isinstance(a, ShardedArray)
        and isinstance(value, torch.Tensor)
        and value.ndim
        and value.shape == a.shape
        and key != _STEP
    ):
        # The state of the whole parameter (saved where it was a plain tensor): each shard takes its box, a tensor
        # of its own (replicas held here would otherwise share one, which the optimizer would step once per replica).
        parts = [
            value[tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))].clone()
            for s in a.addressable_shards
        ]
    else:  # a scalar: every shard tensor gets its own copy (optimizers step them in place)
        for t in own:
            opt.state[t][key] = value.clone() if isinstance(value, torch.Tensor) else value
        return
    for t, v in zip(own, parts):
        v = v.detach()
        floating = v.is_floating_point() and key != _STEP
        opt.state[t][key] = v.to(device=t.device, dtype=t.dtype) if floating else v.to(t.device)
