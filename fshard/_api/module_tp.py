"""Tensor parallelism of a module's Linears (Megatron-style): a plan of module-name patterns to styles.

``tensor_parallel(mesh, {"*.q": "colwise", "*.proj": "rowwise"})`` is at once the rules of
``shard_module`` (each parameter's spec) and what ``apply_module(..., rules=)`` needs to run
the unmodified module: each parameter's block inside the body, and which Linears' products
are summed over the tensor-parallel axis (``psum``) before their bias.
"""

# The public functions check their arguments at run time, whatever the annotations promise.
# pyright: reportUnnecessaryIsInstance=false

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from fshard._api.psum import psum
from fshard._errors import SpecError
from fshard._exec import body as _body
from fshard._layout.specs import Mesh, Named, Partial

__all__ = ["TensorParallel", "row_parallel_class", "tensor_parallel"]

Style = Literal["colwise", "rowwise"]
_STYLES = ("colwise", "rowwise")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """A tensor-parallel plan on a mesh; build it with ``fshard.tensor_parallel``.

    Called as ``rules(name, tensor)`` it gives a parameter's spec (``shard_module``'s rules).
    ``rows`` is the spec of a batch (rows split over ``dp``) and ``summed`` that of a loss
    summed over a placement's rows (a pending sum over ``dp``, equal along ``tp``).
    """

    mesh: Mesh
    plan: tuple[tuple[str, Style], ...]
    tp: str
    dp: str | None
    fsdp: bool

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"TensorParallel mesh must be a fshard.Mesh, got {type(self.mesh).__name__}.")
        plan: Any = self.plan
        if not isinstance(plan, tuple) or not all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and e[1] in _STYLES  # pyright: ignore[reportUnknownArgumentType]
            for e in cast("tuple[Any, ...]", plan)
        ):
            msg = (
                f"TensorParallel plan must be a tuple of (pattern, style) pairs, styles one of {_STYLES}, got "
                f"{_brief(plan)}: build it with fshard.tensor_parallel(mesh, plan)."
            )
            raise SpecError(msg)
        for what, axis in (("tp", self.tp), ("dp", self.dp)):
            if not isinstance(axis, str) and not (what == "dp" and axis is None):
                none = " or None" if what == "dp" else ""
                raise TypeError(f"tensor_parallel() {what} must be a mesh axis name (str){none}, got {axis!r}.")
        if not isinstance(self.fsdp, bool):
            raise TypeError(f"tensor_parallel() fsdp must be a bool, got {self.fsdp!r} ({type(self.fsdp).__name__}).")
        names = self.mesh.axis_names
        for what, axis in (("tp", self.tp), ("dp", self.dp)):
            if axis is not None and axis not in names:
                msg = f"tensor_parallel() {what}={axis!r} is not an axis of the mesh (its axes are {names}): name one."
                raise SpecError(msg)
        if self.tp == self.dp:
            raise SpecError(f"tensor_parallel() tp and dp are both {self.tp!r}: give two different mesh axes.")
        if self.fsdp and self.dp is None:
            raise SpecError("tensor_parallel() fsdp=True shards parameters over dp: give dp= a mesh axis.")

    def __call__(self, name: str, t: torch.Tensor) -> Named:
        """``name``'s spec where it is stored: its body spec, also split over ``dp`` when ``fsdp``."""
        body = self.body_spec(name)
        return self._over_dp(body, tuple(t.shape)) if self.fsdp else body

    def style(self, module_name: str) -> Style | None:
        """The style of the first pattern that names the submodule ``module_name`` (``None``: replicated)."""
        return next((style for pattern, style in self.plan if fnmatch.fnmatchcase(module_name, pattern)), None)

    def body_spec(self, name: str) -> Named:
        """The spec of parameter ``name``'s block inside ``apply_module``'s body."""
        owner, _, kind = name.rpartition(".")
        style = self.style(owner)
        if style == "colwise":
            return Named(self.mesh, (self.tp,))  # weight (out, in) and bias (out,) by output feature
        if style == "rowwise" and kind == "weight":
            return Named(self.mesh, (None, self.tp))  # by input feature; the bias stays whole
        return Named(self.mesh, ())

    @property
    def rows(self) -> Named:
        """A batch's spec: rows split over ``dp``, whole along ``tp``."""
        return Named(self.mesh, () if self.dp is None else (self.dp,))

    @property
    def summed(self) -> Any:
        """A per-placement sum's spec (a loss): pending over ``dp``, replicated along ``tp``."""
        whole = Named(self.mesh, ())
        return whole if self.dp is None else Partial(whole, over=(self.dp,))

    def check(self, module: torch.nn.Module) -> dict[int, str]:
        """The ``id``s of ``module``'s row-parallel submodules, each with the axis its product is summed over.

        Raises:
            SpecError: a pattern that names no submodule, or names one that is not a ``torch.nn.Linear``.
        """
        # Every name of a submodule used under several (one block reused at each depth): a plan may name any,
        # where it gives the first name, by which its parameters are laid out, the same style.
        names = dict(module.named_modules(remove_duplicate=False))  # pyright: ignore[reportUnknownArgumentType]
        first: dict[int, str] = {}
        for n, sub in names.items():
            first.setdefault(id(sub), n)
        rows: dict[int, str] = {}
        for pattern, style in self.plan:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                msg = (
                    f"tensor_parallel() pattern {pattern!r} names no submodule (the module has "
                    f"{list(names)[1:7]}...); fix the pattern or remove it."
                )
                raise SpecError(msg)
            for n in hits:
                sub = names[n]
                _check_linear(n, sub, style)
                name = first[id(sub)]
                if self.style(name) != self.style(n):
                    msg = (
                        f"tensor_parallel() makes {n!r} {self.style(n) or 'whole'}, but it is the submodule "
                        f"{name!r} (one submodule under several names), which the plan makes "
                        f"{self.style(name) or 'whole'}: give every name of it one style ({name!r} too, or a "
                        "pattern for all of them, as 'layers.*.up')."
                    )
                    raise SpecError(msg)
                if self.style(n) == "rowwise":
                    rows[id(sub)] = self.tp
        return rows

    def _over_dp(self, body: Named, shape: tuple[int, ...]) -> Named:
        """``body`` with ``dp`` also splitting the first dim long enough for it (fully sharded over ``dp``)."""
        n = self.mesh.shape[self.mesh.axis_names.index(cast("str", self.dp))]
        parts = list(body.partition) + [None] * (len(shape) - len(body.partition))
        for d, p in enumerate(parts):
            if p is None and shape[d] >= n:
                parts[d] = self.dp
                return Named(self.mesh, parts)
        return body


def _check_linear(name: str, sub: torch.nn.Module, style: str) -> None:
    if not isinstance(sub, torch.nn.Linear) or type(sub).forward is not torch.nn.Linear.forward:
        msg = (
            f"tensor_parallel() makes submodule {name!r} {style}, but it is a {type(sub).__name__}: only "
            "torch.nn.Linear modules (with Linear's forward) can be split; narrow the pattern."
        )
        raise SpecError(msg)
    if isinstance(sub, NonDynamicallyQuantizableLinear):  # MultiheadAttention's out_proj
        msg = (
            f"tensor_parallel() makes submodule {name!r} {style}, but it is a MultiheadAttention's out_proj, "
            "whose weight the attention reads itself (F.multi_head_attention_forward), never through the "
            "Linear's forward, where the split is undone: leave it out of the plan (narrow the pattern), or "
            "write the attention with Linear modules of its own."
        )
        raise SpecError(msg)


def tensor_parallel(
    mesh: Mesh, plan: Mapping[str, str], *, tp: str = "tp", dp: str | None = "dp", fsdp: bool = False
) -> TensorParallel:
    """Megatron-style tensor parallelism: a plan of submodule-name patterns to ``"colwise"``/``"rowwise"``.

    The rules read like torch's ``parallelize_module(model, mesh, {"q": ColwiseParallel(), ...})``.
    The first ``fnmatch`` pattern that names a ``torch.nn.Linear`` sets its style:

    - ``"colwise"``: weight and bias split by output feature over ``tp``; each placement
      computes its own output features (its own attention heads);
    - ``"rowwise"``: weight split by input feature over ``tp``; each placement's product is
      a summand, summed over ``tp`` (``fshard.psum``) before the (whole) bias is added.

    Every other parameter is whole on every placement. Parameters are replicated over
    ``dp`` or, with ``fsdp=True``, also split over ``dp`` where stored and gathered for the
    forward. Pass the result as ``shard_module``'s rules and as ``apply_module``'s
    ``rules=``; batches go in as ``rules.rows`` (rows split over ``dp``) and a summed loss
    comes out as ``rules.summed``. Attention must reshape with ``-1`` heads
    (``view(b, t, -1, head_dim)``, as Hugging Face's Llama does), since each placement
    holds ``heads / tp`` of them. Under ``torch.utils.checkpoint`` (``use_reentrant=False``) a
    row-parallel Linear's recomputation reuses the sum its forward computed, so each must be
    called once per forward.

    Args:
        mesh: the mesh of the placements the module runs on.
        plan: submodule-name patterns (``"*.q_proj"``, ``"blocks.*.fc"``) to styles, tried in order.
        tp: the mesh axis that splits the Linears.
        dp: the mesh axis that splits batches, or ``None``.
        fsdp: also split each parameter over ``dp`` (the first dim long enough) where it is stored.

    Returns:
        The rules, a ``TensorParallel``.

    Raises:
        SpecError: an axis the mesh lacks, or a style other than ``"colwise"``/``"rowwise"``.
        TypeError: ``mesh`` is not a ``Mesh``, ``plan`` not a mapping, ``tp``/``dp`` not axis
            names, or ``fsdp`` not a bool.

    >>> import torch, fshard
    >>> mesh = fshard.Mesh((1, 2), axis_names=("dp", "tp"))
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> rules = fshard.tensor_parallel(mesh, {"0": "colwise", "2": "rowwise"})
    >>> params, buffers = fshard.shard_module(model, rules)
    >>> [tuple(s.data.shape) for s in params["2.weight"].addressable_shards]
    [(4, 4), (4, 4)]
    >>> x = torch.randn(3, 4)
    >>> out, _ = fshard.apply_module(model, params, buffers, fshard.shard(x, rules.rows), rules=rules)
    >>> torch.allclose(fshard.gather(out), model(x))
    True
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"tensor_parallel() takes a fshard.Mesh, got {type(mesh).__name__}.")
    if not isinstance(plan, Mapping):
        raise TypeError(f"tensor_parallel() plan must map name patterns to styles, got {type(plan).__name__}.")
    items = list(cast("Mapping[Any, Any]", plan).items())
    for pattern, style in items:
        if not isinstance(pattern, str) or style not in _STYLES:
            msg = (
                f"tensor_parallel() plan entry {pattern!r}: {style!r}: keys are fnmatch patterns (str) and "
                f"styles one of {_STYLES}."
            )
            raise SpecError(msg)
    return TensorParallel(mesh, tuple(items), tp, dp, fsdp)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.cache
def row_parallel_class(cls: type[torch.nn.Linear]) -> type[torch.nn.Linear]:
    """A subclass of ``cls`` whose forward sums its product over the clone's ``_tp_axis`` before the bias."""
    return type(f"RowParallel{cls.__name__}", (cls,), {"forward": _row_forward, "__module__": __name__})


def _row_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    state, y = vars(self), F.linear(x, self.weight)
    if _body.current() is None:  # recomputed by torch.utils.checkpoint in the backward
        y = _forward_sum(state)  # after the product, which saves the tensors the forward saved
    else:
        y = psum(y, state["_tp_axis"])
        state.setdefault("_tp_sums", []).append(y.detach())
    bias = cast("torch.Tensor | None", self.bias)  # None where the Linear was built with bias=False
    return y if bias is None else y + bias


def _forward_sum(state: dict[str, Any]) -> torch.Tensor:
    """The sum this clone's forward computed: a recomputation outside the body cannot meet the other placements.

    ``torch.utils.checkpoint`` (``use_reentrant=False``) recomputes only to refill saved
    tensors; the backward runs through the forward's own graph, whose sum spans every
    placement, so the forward's value is what the recomputation needs.
    """
    sums = cast("list[torch.Tensor] | None", state.get("_tp_sums"))
    if sums is None or len(sums) != 1:
        msg = (
            "apply_module(): a row-parallel Linear was recomputed outside its shard_map body (activation "
            f"checkpointing), but its clone ran {0 if sums is None else len(sums)} times in the forward; "
            "checkpointing under tensor parallelism needs each row-parallel Linear called once per forward."
        )
        raise SpecError(msg)
    return sums[0]
