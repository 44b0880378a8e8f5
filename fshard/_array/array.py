"""``ShardedArray``: an immutable value of local shards plus global layout metadata."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Union

import optree
import optree.registry
import torch
import torch.utils._pytree as torch_pytree

from fshard._base.calls import refuse_in_block_function
from fshard._base.compile import opaque
from fshard._errors import LayoutError
from fshard._layout.batch import batched_layout
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.show import layout_repr

__all__ = ["Shard", "ShardedArray"]

# Arguments are checked at run time whatever their annotations say: callers may be untyped.
# pyright: reportUnnecessaryIsInstance=false


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Shard:
    """One box of a global array (``meta``) and the tensor holding it (``data``)."""

    meta: ShardMeta
    data: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.meta, ShardMeta):
            raise TypeError(f"Shard meta must be a ShardMeta, got {type(self.meta).__name__}: {self.meta!r}.")
        if not isinstance(self.data, torch.Tensor):
            raise TypeError(f"Shard data must be a torch.Tensor, got {type(self.data).__name__}.")
        if tuple(self.data.shape) != self.meta.sizes:
            msg = f"Shard data has shape {tuple(self.data.shape)} but its box has sizes {self.meta.sizes}."
            raise LayoutError(msg)


class ShardedArray:
    """A global array as local shards plus a ``Layout``; immutable, a pytree node.

    Build one with ``fshard.shard``, a creation function or ``from_local_shards*``;
    change it only by calling a function that returns a new array.

    As a pytree, its leaves are the addressable shards' tensors. A process that holds
    no shard of it (under torch_dist) has one leaf instead: a 0-element tensor of its
    dtype that carries its autograd history, so that the process still takes part in
    every collective of a backward pass through the array.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(6.0).reshape(2, 3), fshard.Chunk(1, [0, 1]))
    >>> x.shape, x.size(-1), [s.data.shape for s in x.addressable_shards]
    (torch.Size([2, 3]), 3, [torch.Size([2, 2]), torch.Size([2, 1])])
    """

    __slots__ = ("_backend", "_data", "_dtype", "_layout", "_link")
    _layout: Layout
    _data: tuple[torch.Tensor, ...]
    _backend: Any
    _dtype: torch.dtype
    # The link: on a process that holds no shard of the array, a 0-element tensor that
    # carries the dtype and the autograd history, so that this process joins every
    # backward collective of the array (``None`` where there are shards, which carry
    # both). Only this class makes or reads it: ``_first`` hands it to a movement as the
    # tensor that stands for the array, and the constructor takes the movement's.
    _link: torch.Tensor | None

    @opaque  # checks shards against the layout in numpy: run eagerly under torch.compile
    def __init__(
        self,
        layout: Layout,
        data: Sequence[torch.Tensor],
        backend: Any,
        dtype: torch.dtype | None = None,
        link: torch.Tensor | None = None,
        *,
        requires_grad: bool = False,
    ) -> None:
        """An array of this process's shard tensors ``data`` (in ``backend.addressable(layout)`` order).

        Where ``data`` is empty, ``dtype`` gives the dtype and ``link`` the link: the one a
        movement returned, or (``None``) a new leaf that requires grad if ``requires_grad``
        does; where there is data, ``link`` is not needed and is dropped.
        """
        if not isinstance(layout, Layout):
            raise TypeError(f"ShardedArray layout must be a Layout, got {type(layout).__name__}.")
        if not callable(getattr(backend, "addressable", None)):
            raise TypeError(f"ShardedArray backend must be an fshard backend, got {type(backend).__name__}.")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"ShardedArray dtype must be a torch.dtype or None, got {dtype!r}.")
        if isinstance(data, torch.Tensor) or not isinstance(data, Iterable):
            raise TypeError(f"ShardedArray data must be a sequence of tensors, got {type(data).__name__}.")
        data = tuple(data)
        index = backend.addressable(layout)
        if len(data) != len(index):
            msg = f"Expected {len(index)} addressable shard tensors for {layout!r}, got {len(data)}."
            raise LayoutError(msg)
        for i, t in zip(index, data):
            _check_tensor(layout, i, t)
        if len({t.dtype for t in data}) > 1:
            msg = f"Shard tensors have different dtypes {[t.dtype for t in data]}: give every shard one dtype."
            raise LayoutError(msg)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_data", data)
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_dtype", data[0].dtype if data else (dtype or torch.get_default_dtype()))
        if data:
            link = None
        elif link is None:
            link = _new_link(self._dtype, requires_grad)
        elif link.numel():
            msg = f"A ShardedArray with no shard here has a 0-element link, got one of shape {tuple(link.shape)}."
            raise LayoutError(msg)
        object.__setattr__(self, "_link", link)

    @classmethod
    def _of(
        cls, layout: Layout, data: tuple[torch.Tensor, ...], backend: Any, dtype: torch.dtype, link: torch.Tensor
    ) -> ShardedArray:
        """An array from a movement's results, which fit ``layout`` by construction: ``__init__`` without its checks.

        A movement of a small array should not pay for them.
        """
        out = object.__new__(cls)
        _set_layout(out, layout)  # the slots' own setters: half the cost of object.__setattr__
        _set_data(out, data)
        _set_backend(out, backend)
        _set_dtype(out, data[0].dtype if data else dtype)
        _set_link(out, None if data else link)
        return out

    @classmethod
    def _many(
        cls, layouts: Iterable[Layout], data: Iterable[tuple[torch.Tensor, ...]], backend: Any, dtype: torch.dtype
    ) -> list[ShardedArray]:
        """``_of`` of each layout and its shards, in one loop; every array holds a shard here, of ``dtype``.

        A tree's movement makes an array per leaf: the loop, not a call per leaf.
        """
        out: list[ShardedArray] = []
        new, put = object.__new__, out.append
        for layout, shards in zip(layouts, data):
            a = new(cls)
            _set_layout(a, layout)
            _set_data(a, shards)
            _set_backend(a, backend)
            _set_dtype(a, dtype)
            _set_link(a, None)
            put(a)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        msg = f"ShardedArray is immutable: cannot set {name!r}; fshard functions return new arrays."
        raise AttributeError(msg)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ShardedArray is immutable: cannot delete {name!r}.")

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardedArray, (self._layout, self._data, self._backend, self._dtype))

    @opaque
    def __repr__(self) -> str:
        return array_repr(self)

    if TYPE_CHECKING:  # installed by ``fshard._api.operators.install()``, which ``import fshard`` runs
        Operand = Union["ShardedArray", bool, int, float, complex]

        def __add__(self, other: Operand) -> ShardedArray: ...
        def __radd__(self, other: Operand) -> ShardedArray: ...
        def __sub__(self, other: Operand) -> ShardedArray: ...
        def __rsub__(self, other: Operand) -> ShardedArray: ...
        def __mul__(self, other: Operand) -> ShardedArray: ...
        def __rmul__(self, other: Operand) -> ShardedArray: ...
        def __truediv__(self, other: Operand) -> ShardedArray: ...
        def __rtruediv__(self, other: Operand) -> ShardedArray: ...
        def __pow__(self, other: Operand) -> ShardedArray: ...
        def __rpow__(self, other: Operand) -> ShardedArray: ...
        def __eq__(self, other: Operand) -> ShardedArray: ...  # type: ignore[override]
        def __ne__(self, other: Operand) -> ShardedArray: ...  # type: ignore[override]
        def __lt__(self, other: Operand) -> ShardedArray: ...
        def __le__(self, other: Operand) -> ShardedArray: ...
        def __gt__(self, other: Operand) -> ShardedArray: ...
        def __ge__(self, other: Operand) -> ShardedArray: ...
        def __neg__(self) -> ShardedArray: ...
        def __bool__(self) -> bool: ...
        def sum(self, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> ShardedArray: ...

    @property
    def layout(self) -> Layout:
        """The global layout metadata."""
        return self._layout

    @property
    def backend(self) -> Any:
        """The backend that holds the addressable shards."""
        return self._backend

    @property
    def shape(self) -> torch.Size:
        """Global shape."""
        return torch.Size(self._layout.shape)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self._layout.ndim

    def dim(self) -> int:
        """Number of dimensions (torch spelling)."""
        return self._layout.ndim

    def size(self, dim: int | None = None) -> Any:
        """The global shape, or its extent along ``dim`` (negative dims count from the end).

        Raises:
            IndexError: "Dimension out of range" for a ``dim`` outside ``[-ndim, ndim)``.
        """
        if dim is None:
            return self.shape
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"size() dim must be an int or None, got {dim!r} ({type(dim).__name__}).")
        n = self.ndim
        if not -n <= dim < n:
            msg = f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})"
            raise IndexError(msg)
        return self._layout.shape[dim]

    def numel(self) -> int:
        """Number of elements of the global array."""
        return self._layout.numel

    @property
    def dtype(self) -> torch.dtype:
        """Element type (every shard has it)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """Device of the first addressable shard (each shard sits on its placement's device)."""
        return self._first().device

    @property
    def requires_grad(self) -> bool:
        """Whether the shards take part in autograd (on every process, including one without shards)."""
        if self._link is not None:
            return self._link.requires_grad
        try:
            return any(t.requires_grad for t in self._data)
        except AttributeError:  # no tensors: a tree map's container of other leaves
            raise _of_other_leaves(self) from None

    @property
    @opaque  # builds ShardMetas from the layout's columns
    def addressable_shards(self) -> tuple[Shard, ...]:
        """The shards held by this process: all of them (local) or this rank's (torch_dist)."""
        refuse_in_block_function("the addressable_shards of an array were read")
        idx = self._backend.addressable(self._layout)
        # Layout._shard is fshard-internal: it makes one ShardMeta without making the others.
        return tuple(Shard(self._layout._shard(i), t) for i, t in zip(idx, self._data))  # pyright: ignore[reportPrivateUsage]

    @property
    def addressable_data(self) -> tuple[torch.Tensor, ...]:
        """The tensors of ``addressable_shards``."""
        refuse_in_block_function("the addressable_data of an array was read")
        return self._data

    @opaque
    def local_tensor(self) -> torch.Tensor:
        """The one addressable shard's tensor.

        It is the array's own storage, not a copy (as are the tensors of
        ``addressable_shards`` and ``addressable_data``), and other values may share
        it: the tensors given to ``from_local_shards*`` are the shards themselves, a
        no-op ``reshard`` returns its input, and a ``map_local`` of ``lambda t: t``
        shares its input's shards. Treat it as read-only: an in-place write changes
        every array and tensor that shares it. ``map_local`` and ``shard_map`` raise
        ``SpecError`` when their function writes into an input block; for a private
        copy, ``.clone()``.

        >>> import torch, fshard
        >>> mine = torch.zeros(2)
        >>> lay = fshard.Single(0).layout((2,))
        >>> a = fshard.from_local_shards_and_layout([fshard.Shard(lay.shards[0], mine)], lay)
        >>> a.local_tensor() is mine
        True

        Raises:
            NotImplementedError: "Only single local shard is supported." otherwise.
        """
        refuse_in_block_function("local_tensor() of an array was called")
        if len(self._data) != 1:
            msg = f"Only single local shard is supported. This process holds {len(self._data)}; use addressable_shards."
            raise NotImplementedError(msg)
        return self._data[0]

    def backward(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Raises ``TypeError``: an array's backward is ``fshard.backward(loss)``, or ``gather(loss).backward()``.

        A loss that is a sum over the ranks (``Partial``) has no value on any one rank until it
        is summed, so it has no ``Tensor.backward`` of its own.

        >>> import torch, fshard
        >>> w = torch.arange(4.0, requires_grad=True)
        >>> total = fshard.shard_map(lambda b: (b * b).sum()[None], in_specs=(fshard.Chunk(0, [0, 1]),),
        ...                          out_specs=fshard.Partial(fshard.Replicated([0, 1])))(w)
        >>> total.backward()
        Traceback (most recent call last):
        ...
        TypeError: A ShardedArray has no backward() of its own: call fshard.backward(loss) ...
        >>> fshard.backward(total)
        tensor([14.])
        """
        msg = (
            "A ShardedArray has no backward() of its own: call fshard.backward(loss) on a one-element loss "
            "(where it is a sum over the ranks, each rank's backward starts from its own summand), or "
            "fshard.gather(loss).backward()."
        )
        raise TypeError(msg)

    def _first(self) -> torch.Tensor:
        """The tensor that stands for this array in a movement: the first shard, or the link.

        It gives the movement its dtype, device and autograd history.
        """
        first = self._link if self._link is not None else self._data[0]
        if not isinstance(first, torch.Tensor):
            raise _of_other_leaves(self)
        return first

    def _link_view(self) -> torch.Tensor:
        """A 0-element view of ``_first()``.

        It is the link of a result computed from this array that holds no shard on this process.
        """
        return self._first().reshape(-1)[:0]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        msg = (
            f"torch.{name} is not supported for ShardedArray: apply it to the shards with "
            "fshard.map_local, or gather() first."
        )
        raise TypeError(msg)


def _of_other_leaves(x: ShardedArray) -> TypeError:
    """The error for a node of other leaves than tensors (a tree map's result) where an array is needed."""
    kinds = sorted({type(c).__name__ for c in _children(x)})
    return TypeError(
        f"This ShardedArray holds {', '.join(kinds)} where its shard tensors should be: a pytree map "
        "(optree.tree_map, torch.utils._pytree.tree_map) built it from a function that returns no tensor. "
        "Such a node is a container of those leaves, for tree utilities (torch.func's in_dims): no fshard "
        "function takes it. Map with a function that returns a tensor of each shard's shape, or use "
        "fshard.map_local."
    )


def _new_link(dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    """The link of an array built from nothing on a process without shards (a leaf)."""
    return torch.empty(0, dtype=dtype, requires_grad=requires_grad and (dtype.is_floating_point or dtype.is_complex))


def _check_tensor(layout: Layout, i: int, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        msg = f"Shard {i} of a ShardedArray must be a torch.Tensor, got {type(t).__name__}."
        raise TypeError(msg)
    sizes = tuple(layout.columns.sz[i].tolist())
    if tuple(t.shape) != sizes:
        msg = (
            f"Shard {i} tensor has shape {tuple(t.shape)} but the layout gives it sizes "
            f"{sizes}: a pytree transform must keep every shard's shape."
        )
        raise LayoutError(msg)


def _children(x: ShardedArray) -> tuple[torch.Tensor, ...]:
    """The pytree children: the addressable shards, or the link on a process that holds none."""
    # This function and _flatten are ShardedArray's own pytree hooks, written outside the class.
    return x._data if x._link is None else (x._link,)  # pyright: ignore[reportPrivateUsage]


# The pytree hooks are opaque: optree and torch call them back from code that TorchDynamo traces or runs.
@opaque
def _flatten(x: ShardedArray) -> tuple[tuple[torch.Tensor, ...], tuple[Layout, Any, torch.dtype]]:
    return _children(x), (x._layout, x._backend, x._dtype)  # pyright: ignore[reportPrivateUsage]


_set_layout, _set_data, _set_backend, _set_dtype, _set_link = (
    getattr(ShardedArray, name).__set__ for name in ("_layout", "_data", "_backend", "_dtype", "_link")
)


@opaque
def _unflatten(aux: tuple[Layout, Any, torch.dtype], children: Any) -> ShardedArray:
    children = tuple(children)
    layout, backend, dtype = aux
    if all(isinstance(c, torch.Tensor) for c in children):
        layout = batched_layout(layout, children, backend.addressable(layout)) or layout
        if backend.addressable(layout) or len(children) != 1:
            return ShardedArray(layout, children, backend, dtype)
        # The link carries the dtype where no shard is: a map that casts casts it, as it casts the shards.
        return ShardedArray(layout, (), backend, children[0].dtype, children[0])
    # Tree utilities also rebuild nodes around other leaves (torch.func's in_dims trees hold
    # ints and None): such a node is a container of those leaves, unchecked, as JAX asks.
    node = object.__new__(ShardedArray)
    for name, value in zip(("_layout", "_data", "_backend", "_dtype"), (layout, children, backend, dtype)):
        object.__setattr__(node, name, value)
    object.__setattr__(node, "_link", None)
    return node


@opaque
def _flatten_with_keys(x: ShardedArray) -> tuple[list[tuple[Any, torch.Tensor]], tuple[Layout, Any, torch.dtype]]:
    """The children with torch's keys (``tree_map_with_path``): each named by its position, as optree's paths are."""
    children, aux = _flatten(x)
    return [(torch_pytree.SequenceKey(i), c) for i, c in enumerate(children)], aux


_GLOBAL = getattr(optree.registry, "__GLOBAL_NAMESPACE", "fshard")
optree.register_pytree_node(ShardedArray, _flatten, lambda aux, ch: _unflatten(aux, ch), namespace=_GLOBAL)  # type: ignore[arg-type]
torch_pytree.register_pytree_node(
    ShardedArray,
    opaque(lambda x: (list(_children(x)), (x._layout, x._backend, x._dtype))),
    opaque(lambda children, aux: _unflatten(aux, children)),  # torch passes (children, context)
    serialized_type_name="fshard.ShardedArray",
    flatten_with_keys_fn=_flatten_with_keys,
)


# -- repr: the layout and, where small and all in this process, the values (so that a failing
# example printed by hypothesis can be pasted back) ----------------------------------------------

MAX_VALUES = 64  # an array that stores more elements prints no values


def array_repr(x: ShardedArray) -> str:
    """``ShardedArray(shape, dtype, backend, layout=Layout(...), values=[...])``.

    The values are shown where the backend holds every shard in this process (the
    local backend) and the shards store at most ``MAX_VALUES`` elements: the global
    values, or for a partial layout (whose copies are summands) ``shard_values``, one
    list per shard in layout order. No value is shown from a process that holds only
    some shards: that would need the other processes.
    """
    layout = x.layout
    children = _children(x)
    if not all(isinstance(c, torch.Tensor) for c in children):  # a tree map's container of other leaves
        return f"ShardedArray(shape={tuple(x.shape)}, leaves={list(children)!r}, layout={layout_repr(layout)})"
    head = f"ShardedArray(shape={tuple(x.shape)}, dtype={x.dtype}, backend={x.backend.name}"
    values = _values(x)
    return f"{head}, layout={layout_repr(layout)}{values})"


def _values(x: ShardedArray) -> str:
    layout, shards = x.layout, x.addressable_shards
    if len(shards) != len(layout.shards) or sum(s.data.numel() for s in shards) > MAX_VALUES:
        return ""
    if any(s.data.device.type == "meta" for s in shards):  # no values to show
        return ""
    if layout.partial is not None:
        # torch's stub types tolist() as a bare list, here and below.
        return f", shard_values={[s.data.detach().cpu().tolist() for s in shards]}"  # pyright: ignore[reportUnknownMemberType]
    full = torch.zeros(layout.shape, dtype=x.dtype)
    for s in shards:
        box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
        if all(s.meta.sizes):
            full[box] = s.data.detach().cpu()
    return f", values={full.tolist()}"  # pyright: ignore[reportUnknownMemberType]
