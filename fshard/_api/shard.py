"""``shard``: a global tensor (on every rank, or on one) split into a ``ShardedArray``."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, cast, overload

import optree
import torch

from fshard._api.move import check_plain, check_tensor, is_spec, reshard, resolve_backend, resolved, whole_on
from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._base.compile import opaque
from fshard._errors import SpecError
from fshard._exec import autograd as _autograd
from fshard._exec.collective import collective
from fshard._exec.fused import move_tree
from fshard._exec.replicas import check_global, checking
from fshard._interop.torch_objects import already_sharded, shard_already_sharded
from fshard._layout.layout import Layout, layout_digest, with_partial
from fshard._layout.specs import as_layout
from fshard._layout.torch_meta import is_dtensor, is_sharded_tensor
from fshard.backends import Backend

__all__ = ["shard"]


def _meta_problem(device: str, layout: Layout, what: str) -> str | None:
    """Why a tensor on a device of type ``device`` cannot be sliced into ``layout``.

    On the meta device it has no values to put anywhere but on meta placements.
    """
    if device != "meta":
        return None
    devices = sorted({d for d in layout.columns.devices if torch.device(d).type != "meta"})
    if not devices:
        return None
    return (
        f"{what} is on the meta device, which holds no values, but the spec places shards on {devices}: "
        "place them on the meta device too ('rank:0/meta'), or pass a tensor that holds values."
    )


def _source(tensor: Any, src: int, spec: Any, backend: Backend) -> tuple[tuple[int, ...], torch.Tensor] | _Tree:
    """Agrees on ``src`` across ranks; returns the global shape and the tensor (a stand-in off src).

    Rank ``src`` checks its tensor before the exchange and sends what is wrong with it,
    so a bad source tensor raises on every rank instead of leaving the others waiting.
    Where rank ``src`` passed a pytree of tensors, returns its structure and leaves
    instead (``_Tree``): the same one exchange tells every rank.
    """
    mine = backend.holds(src)
    found: _Tree | None = None
    if mine and _is_tree(tensor):
        found, problem = _flatten(tensor, f" on rank {src}")
    else:
        problem = _source_problem(tensor, src, spec) if mine else None
    if found is not None:
        info = (src, None, None, False, None, found.info())
    elif mine and problem is None and tensor is not None:
        info = (src, tuple(tensor.shape), tensor.dtype, tensor.requires_grad, None, None)
    else:
        info = (src, None, None, False, problem, None)
    seen = backend.exchange((*info, _spec_digest(spec)))
    if len({s[0] for s in seen}) != 1:
        msg = f"src={src} on rank {backend.rank} does not match with src_rank on other ranks: {[s[0] for s in seen]}."
        raise SpecError(msg)
    _check_specs_alike(src, [s[6] for s in seen], backend)
    bad = next((s[4] for s in seen if s[4] is not None), None)
    if bad is not None:
        kind, msg = bad
        raise (TypeError if kind == "TypeError" else SpecError)(msg)
    # Entries follow group order, not global ranks: the owner is the one that sent a shape (or a tree).
    owner = next(s for s in seen if s[1] is not None or s[5] is not None)
    if owner[5] is not None:
        return found if found is not None else _Tree.of(owner[5])
    if mine:
        return owner[1], resolved(cast("torch.Tensor", tensor))
    # The stand-in requires grad like the source, so every rank's shards join autograd alike.
    return owner[1], torch.empty(0, dtype=owner[2], requires_grad=owner[3])


def _spec_digest(spec: Any) -> str:
    """A digest of ``spec`` (one spec, or a pytree of them: dict keys sorted), alike on every process.

    A ``Layout`` counts by its digest: its repr would make an object per shard. Devices are
    left out, as ``layout_digest`` leaves them out: ranks may name one GPU each their own way.
    """
    paths, leaves, _ = optree.tree_flatten_with_path(spec, is_leaf=is_spec, none_is_leaf=True)
    h = hashlib.blake2b(repr(paths).encode(), digest_size=8)
    for leaf in leaves:
        h.update(layout_digest(leaf) if isinstance(leaf, Layout) else _DEVICE.sub("", repr(leaf)).encode())
    return h.hexdigest()


_DEVICE = re.compile(r", device='[^']*'")  # a Placement's device in a spec's repr


def _check_specs_alike(src: int, digests: list[str], backend: Backend) -> None:
    """Raises on every rank where the ranks passed different specs.

    A spec that fits rank ``src``'s tensors on some ranks only would raise on those alone,
    after the exchange, and leave the others waiting.
    """
    if len(set(digests)) == 1:
        return
    group: Any = backend  # the one that exchanged, so a group of processes: its ranks in the exchange's order
    ranks: list[int] = list(group.ranks)
    mine = digests[ranks.index(group.rank)]
    like = [r for r, d in zip(ranks, digests) if d == mine]
    other = [r for r, d in zip(ranks, digests) if d != mine]
    msg = (
        f"shard(..., src={src}): ranks {like} passed another spec than ranks {other}: every rank lays out the "
        f"tensors that rank {src} sends by its own spec, so give every rank the same spec."
    )
    raise SpecError(msg)


def _source_problem(tensor: Any, src: int, spec: Any) -> tuple[str, str] | None:
    """What is wrong with rank ``src``'s source tensor, as (exception type, message), or ``None``."""
    if tensor is None:
        return "SpecError", f"shard(..., src={src}) needs a tensor on rank {src}, got None."
    found = already_sharded(tensor)
    if found is not None:
        kind, where, convert = found
        msg = (
            f"shard(..., src={src}) got a torch {kind} on rank {src}: its data already lives on {where}. Convert it "
            f"instead, on every rank: fshard.reshard({convert}, spec)."
        )
        return "SpecError", msg
    try:
        check_tensor(tensor, f"shard() input on rank {src}")
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    if tensor.device.type != "meta":
        return None
    try:
        layout = as_layout(spec, tuple(tensor.shape))
    except (TypeError, ValueError):
        return None  # every rank raises it after the exchange, where the shape is known
    problem = _meta_problem(tensor.device.type, layout, f"shard() input on rank {src}")
    return None if problem is None else ("SpecError", problem)


@overload
def shard(
    tensor: torch.Tensor | None, spec: Any, *, src: int | None = None, backend: Backend | None = None
) -> ShardedArray: ...
@overload
def shard(tensor: Any, spec: Any, *, src: int | None = None, backend: Backend | None = None) -> Any: ...
@collective("shard", local=("tensor",))
@opaque
def shard(tensor: Any, spec: Any, *, src: int | None = None, backend: Backend | None = None) -> Any:
    """Splits a global tensor, or a pytree of them, into ``ShardedArray``s laid out by ``spec``.

    Args:
        tensor: the global tensor, or a pytree of tensors (a dict, list, tuple, ... whose
            leaves are tensors; ``None`` entries stay ``None``). With ``src=None`` every rank
            passes it and slices its own boxes (nothing is sent); with ``src=k`` only rank
            k's is read and other ranks may pass ``None``.
        spec: ``Chunk``, ``Named``, ``Replicated``, ``Single``, ``Explicit`` or a ``Layout``;
            for a tree, one spec for every leaf or a pytree of specs matching the tree.
        src: the rank whose tensor (or tree) is the source, or ``None``.
        backend: defaults to torch_dist when torch.distributed is initialised, else local.

    Returns:
        A new ``ShardedArray`` (for a tree, the tree of them); non-contiguous inputs are
        read correctly, and the result never shares memory with the input.

    With a ``Partial`` spec the array's value is still ``tensor``: one copy of each
    element holds it and the others hold the identity (zero for a sum: -0.0 of a
    floating dtype). A torch ``ShardedTensor`` or ``DTensor`` (with ``src=None``) is
    already sharded: it is converted (``from_sharded_tensor``, ``from_dtensor``), then
    resharded to ``spec``.

    A tree from rank ``src`` takes one exchange (its structure, shapes and dtypes) and then
    moves as one (``reshard`` of a tree): the leaves of one dtype whose boxes are ranges
    of their row-major order in one collective per phase, at the sum of the leaves'
    minimum elements sent. A leaf that is not a tensor is refused, naming its path: leave
    it out of the tree.

    Raises:
        TypeError: the input, or a leaf of the tree, is not a tensor.
        SpecError: the spec does not fit ``tensor.shape`` (for a tree, a note names the
            leaf), the specs do not match the tree, or ranks disagree on ``src``; or it is
            called inside a ``map_local``/``shard_map`` fn, whose tensors are one
            placement's (make the array outside fn and pass it in).
        CollectiveMismatchError: in check mode, with ``src=None``, ranks passed different
            tensors (compared bit for bit by digest); per-rank batches belong in
            ``fshard.from_local_tensor(t, dim=0)``.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(10.0), fshard.Chunk(0, [0, 1, 2, 3]))
    >>> [tuple(s.data.tolist()) for s in x.addressable_shards]
    [(0.0, 1.0, 2.0), (3.0, 4.0, 5.0), (6.0, 7.0, 8.0), (9.0,)]
    >>> params = {"w": torch.ones(4, 2), "b": torch.zeros(2), "scale": None}
    >>> specs = {"w": fshard.Chunk(0, [0, 1]), "b": fshard.Replicated([0, 1]), "scale": None}
    >>> tree = fshard.shard(params, specs, src=0)
    >>> [s.data.shape for s in tree["w"].addressable_shards], tree["scale"]
    ([torch.Size([2, 2]), torch.Size([2, 2])], None)
    """
    if src is None and already_sharded(tensor) is not None:  # converted, then resharded
        return shard_already_sharded(tensor, spec, backend=backend)
    backend = resolve_backend(backend)
    if src is not None:
        src = backend.check_rank(src, "src")
    if src is None:
        if _is_tree(tensor):
            return _shard_tree(tensor, spec, backend)
        full = resolved(check_tensor(tensor, "shard() input"))
        shape: tuple[int, ...] = tuple(full.shape)
        check_global(backend, [(f"shard()'s tensor argument ({full.dtype}, shape {tuple(full.shape)})", full)])
    else:
        source = _source(tensor, src, spec, backend)
        if isinstance(source, _Tree):  # rank src passed a pytree of tensors
            return _send_tree(source, spec, src, backend)
        shape, full = source
    target = as_layout(spec, shape)
    backend.check_layout(target)
    problem = _meta_problem(full.device.type, target, "shard() input") if src is None else None
    if problem is not None:
        raise SpecError(problem)
    # A pending reduction: slice into copies that all hold the value, then keep one of each.
    layout = target if target.partial is None else with_partial(target, None) if src is None else whole_on(target, src)
    data, link = _autograd.scatter(full, layout, backend, src)
    out = ShardedArray(layout, data, backend, full.dtype, link)
    return out if layout is target else reshard(out, target)


# -- pytrees of tensors ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One tensor of a tree passed to ``shard``: what every rank learns of it.

    ``tensor``: the tensor itself, where this process holds it (``None`` off rank ``src``).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    device: str
    tensor: torch.Tensor | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class _Tree:
    """A pytree of tensors passed to ``shard``: its structure and its leaves, in order."""

    treedef: Any
    leaves: tuple[_Leaf, ...]

    @property
    def paths(self) -> list[tuple[Any, ...]]:
        """Each leaf's path in the tree (for messages)."""
        return self.treedef.paths()

    def info(self) -> tuple[Any, ...]:
        """What rank ``src`` tells the others of its tree, as plain data.

        Its structure, the distinct (shape, dtype, requires_grad, device type) of its leaves,
        and which of them each leaf has (nothing where they all have the first): a tree of
        many alike leaves (a model's layers) costs the exchange little.
        """
        kinds: dict[tuple[Any, ...], int] = {}
        which = [kinds.setdefault((x.shape, x.dtype, x.requires_grad, x.device), len(kinds)) for x in self.leaves]
        return self.treedef, tuple(kinds), tuple(which) if len(kinds) > 1 else ()

    @classmethod
    def of(cls, info: tuple[Any, ...]) -> _Tree:
        """The tree ``info()`` describes, without its tensors (off rank ``src``)."""
        treedef, kinds, which = info
        leaves = [_Leaf(*kind) for kind in kinds]
        which = cast("tuple[int, ...]", which)
        if which or not leaves:
            return cls(treedef, tuple(leaves[k] for k in which))
        return cls(treedef, (leaves[0],) * treedef.num_leaves)


def _is_tree(x: Any) -> bool:
    """Whether ``x`` is a pytree of tensors rather than one tensor (or a wrong value).

    A container with a tensor among its leaves, or with no leaves. A container of numbers
    alone (``[1.0, 2.0]``) is a wrong value: it is refused as one, "must be a torch.Tensor".
    """
    if x is None or isinstance(x, (torch.Tensor, ShardedArray)) or is_sharded_tensor(x):
        return False
    leaves, treedef = optree.tree_flatten(x, is_leaf=_is_value)
    return not treedef.is_leaf() and (not leaves or any(isinstance(t, torch.Tensor) for t in leaves))


def _is_value(x: Any) -> bool:
    """The values a tree's flattening stops at: arrays and torch ShardedTensors (refused with their path)."""
    return isinstance(x, ShardedArray) or is_sharded_tensor(x)


def _flatten(tree: Any, where: str) -> tuple[_Tree | None, tuple[str, str] | None]:
    """The tree of tensors ``tree`` as a ``_Tree``, or (exception type, message) for its first bad leaf.

    Every leaf must be a plain strided tensor; ``None`` entries stay ``None`` in the result.
    """
    leaves, treedef = optree.tree_flatten(tree, is_leaf=_is_value)
    out: list[_Leaf] = []
    for k, leaf in enumerate(leaves):
        if (
            not isinstance(leaf, torch.Tensor)
            or leaf.layout != torch.strided
            or leaf.is_nested
            or leaf.is_quantized
            or (type(leaf) is not torch.Tensor and (is_dtensor(leaf) or torch.nn.parameter.is_lazy(leaf)))
        ):
            return None, _leaf_problem(leaf, treedef.paths()[k], where)  # its path, only where it is needed
        t = resolved(leaf)
        out.append(_Leaf(tuple(t.shape), t.dtype, t.requires_grad, t.device.type, t))
    return _Tree(treedef, tuple(out)), None


def _leaf_problem(leaf: Any, path: tuple[Any, ...], where: str) -> tuple[str, str]:
    """What is wrong with a leaf that is no plain tensor, as (exception type, message)."""
    if not isinstance(leaf, torch.Tensor):
        msg = (
            f"shard() takes a tensor or a pytree of tensors{where}; the leaf at {path} is "
            f"of type {type(leaf).__name__}. Leave it out of the tree, or make it a tensor (torch.as_tensor)."
        )
        return "TypeError", msg
    try:
        check_plain(leaf, f"shard() input at {path}{where}")
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError(f"{leaf!r} is a plain tensor")  # the caller found it is not


def _targets(tree: _Tree, spec: Any, backend: Backend) -> list[Layout]:
    """Each leaf's target layout: ``spec`` for every leaf, or its entry of a pytree of specs; checked.

    Cached on the leaves' shapes, device types and specs, so a tree of the same shapes sharded
    again resolves and checks nothing per leaf; specs that cannot be hashed are resolved every time.
    """
    if is_spec(spec):
        specs: tuple[Any, ...] | None = None
    else:
        try:
            specs = tuple(tree.treedef.flatten_up_to(spec))
        except (ValueError, TypeError) as exc:
            msg = f"shard() takes one spec or a pytree of specs matching the tensors ({tree.treedef}): {exc}"
            raise SpecError(msg) from None
    shapes = tuple(x.shape for x in tree.leaves)
    devices = tuple(x.device for x in tree.leaves)
    one = spec if specs is None else None
    try:
        try:
            return list(_cached_layouts(shapes, devices, one, specs, backend))
        except TypeError as exc:
            if "unhashable" not in str(exc):
                raise
            return list(_layouts(shapes, devices, one, specs, backend))
    except _AtLeaf as at:
        error = at.error
        error.add_note(f"(the tensor at {tree.paths[at.leaf]} of shard()'s tree, shape {shapes[at.leaf]})")
        raise error from None


class _AtLeaf(Exception):
    """An error in resolving leaf ``leaf``'s spec (so the caller can name its path)."""

    def __init__(self, leaf: int, error: Exception) -> None:
        super().__init__(leaf, error)
        self.leaf, self.error = leaf, error


def _layouts(
    shapes: tuple[tuple[int, ...], ...],
    devices: tuple[str, ...],
    spec: Any,
    specs: tuple[Any, ...] | None,
    backend: Any,
) -> tuple[Layout, ...]:
    """The target layouts of leaves of ``shapes`` (on device types ``devices``): ``spec``, or ``specs[k]``.

    Raises:
        _AtLeaf: with leaf ``k``'s error, where its spec does not fit it.
    """
    out: list[Layout] = []
    for k, (shape, device) in enumerate(zip(shapes, devices)):
        try:
            target = as_layout(spec if specs is None else specs[k], shape)
            backend.check_layout(target)
            problem = _meta_problem(device, target, f"shard() input (leaf {k})")
            if problem is not None:
                raise SpecError(problem)
        except (TypeError, ValueError) as exc:
            raise _AtLeaf(k, exc) from None
        out.append(target)
    return tuple(out)


_cached_layouts = cached(256)(_layouts)


def _shard_tree(tree: Any, spec: Any, backend: Backend) -> Any:
    """``shard`` of a pytree of tensors present on every rank: each rank slices its boxes, nothing is sent."""
    found, problem = _flatten(tree, "")
    if problem is not None:
        kind, msg = problem
        raise (TypeError if kind == "TypeError" else SpecError)(msg)
    assert found is not None
    fulls = [cast("torch.Tensor", leaf.tensor) for leaf in found.leaves]
    if checking():  # one exchange for the whole tree
        described = [
            f"the tensor at {path} of shard()'s tree ({x.dtype}, shape {x.shape})"
            for path, x in zip(found.paths, found.leaves)
        ]
        # The leaves' paths, not the treedef's text, which may show a node's metadata by address.
        check_global(backend, list(zip(described, fulls)), tree=("shard()'s tree", f"leaves at {found.paths}"))
    targets = _targets(found, spec, backend)
    arrays: list[ShardedArray] = []
    for full, target in zip(fulls, targets):
        layout = target if target.partial is None else with_partial(target, None)
        data, link = _autograd.scatter(full, layout, backend, None)
        arrays.append(ShardedArray(layout, data, backend, full.dtype, link))
    # Pending reductions keep one summand of each element: nothing crosses ranks.
    return optree.tree_unflatten(found.treedef, move_tree(arrays, targets))


def _send_tree(tree: _Tree, spec: Any, src: int, backend: Backend) -> Any:
    """``shard(..., src=src)`` of a pytree: every leaf's boxes sent from rank ``src`` in one fused movement.

    Each leaf is first the whole array on rank ``src`` (its own tensor there), then every
    leaf moves to its target in ``move_tree``: one collective per phase and dtype.
    """
    targets = _targets(tree, spec, backend)
    arrays: list[ShardedArray] = []
    for leaf, target in zip(tree.leaves, targets):
        whole = whole_on(target, src)
        if leaf.tensor is None:  # the process holds no shard: the link requires grad like the source
            arrays.append(ShardedArray(whole, (), backend, leaf.dtype, requires_grad=leaf.requires_grad))
            continue
        device = torch.device(whole.columns.devices[0])
        t = leaf.tensor if leaf.tensor.device == device else leaf.tensor.to(device)
        arrays.append(ShardedArray._of(whole, (t,), backend, t.dtype, t))  # pyright: ignore[reportPrivateUsage]  # fits by construction
    moved = move_tree(arrays, targets)
    for k, (a, b) in enumerate(zip(arrays, moved)):
        if a is b and a.addressable_data:  # already in place (a Single(src) target): a copy, as shard() makes
            copies = tuple(torch.clone(t, memory_format=torch.contiguous_format) for t in a.addressable_data)
            moved[k] = ShardedArray(a.layout, copies, backend)
    return optree.tree_unflatten(tree.treedef, moved)
