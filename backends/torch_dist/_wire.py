"""The data-only encoding of what ranks exchange: nothing read from a peer or the store is unpickled.

The rendezvous store listens on every network interface, and a peer's bytes are only as
trustworthy as the peer, so ``decode`` treats its input as untrusted: it builds values
from JSON, of the few kinds fshard exchanges, and never calls code that the input names
(no pickle, no imports). ``encode`` refuses anything else on the sending side.

The kinds: ``None``, ``bool``, ``int``, ``float``, ``str``, ``complex``, ``bytes``, tuples,
lists, sets, dicts (and ``OrderedDict``); ``torch.dtype``, ``torch.Size``, ``torch.device``;
``Layout``, ``ShardMeta``, ``Placement`` and fshard's own records; optree tree structures
(of tuples, lists, dicts, ``None`` and named tuples of modules already imported); and
exceptions, as a type name and plain arguments. Exception types outside ``_ERRORS`` travel
as ``RuntimeError("TypeName: message")``.

>>> import torch
>>> from fshard.backends.torch_dist._wire import decode, encode
>>> decode(encode((1, "a", [torch.float32], {"k": None})))
(1, 'a', [torch.float32], {'k': None})
"""

from __future__ import annotations

import builtins
import collections
import functools
import json
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import optree
import torch

from fshard import _errors
from fshard._base.records import count, records
from fshard._errors import CollectiveMismatchError, SpecError
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.placement import Placement

__all__ = ["MAX_BYTES", "Unsendable", "decode", "encode", "refuse"]

# The most bytes one encoded value may take: metadata, never tensor data.
MAX_BYTES = 64 << 20
_MAX_DEPTH = 48
_BUILTIN_ERRORS = (
    "ArithmeticError",
    "AssertionError",
    "AttributeError",
    "EOFError",
    "Exception",
    "FileExistsError",
    "FileNotFoundError",
    "IndexError",
    "IsADirectoryError",
    "KeyError",
    "KeyboardInterrupt",
    "LookupError",
    "MemoryError",
    "NotADirectoryError",
    "NotImplementedError",
    "OSError",
    "OverflowError",
    "PermissionError",
    "RecursionError",
    "RuntimeError",
    "SystemExit",
    "TimeoutError",
    "TypeError",
    "UnicodeError",
    "ValueError",
    "ZeroDivisionError",
)
# The exception types that travel as themselves; a name maps to the class, never to code named by the input.
_ERRORS: dict[str, type[BaseException]] = {
    **{n: getattr(builtins, n) for n in _BUILTIN_ERRORS},
    **{n: getattr(_errors, n) for n in _errors.__all__},
}
_SCALARS = (type(None), bool, int, float, str)
# (value, where, depth) -> the JSON items after the kind; (items, depth) -> the value.
_Encoder = Callable[[Any, Any, int], list[Any]]
_Decoder = Callable[[list[Any], int], Any]


class Unsendable(NamedTuple):
    """Sent in place of a value that ``encode`` refused, so that every rank raises rather than waits."""

    message: str


def encode(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON.

    Raises:
        SpecError: ``obj`` holds a value of a kind that ranks do not exchange (named, with where it sits).
    """
    return json.dumps(_enc(obj, "value", 0), separators=(",", ":")).encode()


def decode(data: bytes, source: str = "a peer", *, peer: bool = False) -> Any:
    """The value that ``encode`` made ``data`` from; ``source`` names where it came from in errors.

    ``peer``: ``data`` came from a rank in an exchange (``refuse`` says what that usually means).

    Raises:
        CollectiveMismatchError: ``data`` is too large, not JSON, or not a value ``encode`` makes.
    """
    if len(data) > MAX_BYTES:
        raise refuse(source, f"{len(data)} bytes, more than the {MAX_BYTES} that metadata may take", peer=peer)
    try:
        return _dec(json.loads(data.decode()), 0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError) as exc:
        raise refuse(source, f"{type(exc).__name__}: {exc}"[:300], peer=peer) from None


def refuse(source: str, why: str, *, peer: bool = False) -> CollectiveMismatchError:
    """The error for bytes from ``source`` that are not an encoded value (every rank that read them raises it).

    ``peer``: from a rank in an exchange, where the usual cause is a rank in another call (check
    mode, which names such calls, writes its own entries to the store: no advice for those).
    """
    cause = (
        "Most often the ranks called different fshard functions here (every rank must make the same calls "
        "with the same arguments; fshard.config(check_collectives=True) names the calls that differ). "
        if peer
        else ""
    )
    msg = (
        f"Refused metadata from {source}: {why}. fshard decodes only what fshard encodes, so these bytes are "
        f"not metadata. {cause}If something outside the job can write to the rendezvous store, bind it to a "
        "private interface (MASTER_ADDR)."
    )
    return CollectiveMismatchError(msg)


# -- encoding ---------------------------------------------------------------------------


def _enc(x: object, where: Any, depth: int) -> Any:
    """``x`` as JSON data; ``where`` is its path, ``(parent path, suffix)``, spelled out only in errors."""
    if type(x) in _SCALARS:
        return x
    if depth > _MAX_DEPTH:
        raise SpecError(f"Cannot exchange {_path(where)}: nested deeper than {_MAX_DEPTH} levels.")
    exact = _EXACT.get(type(x))  # the common kinds, without trying each test in turn
    if exact is not None:
        return [exact[0], *exact[1](x, where, depth + 1)]
    for kind, test, fn in _ENCODERS:
        if test(x):
            return [kind, *fn(x, where, depth + 1)]
    msg = (
        f"Cannot exchange {_path(where)}, a {type(x).__module__}.{type(x).__qualname__}: ranks exchange only data "
        "(None, bool, int, float, str, tuples, lists, dicts, dtypes, layouts, tree structures of those, "
        "fshard errors). Return or pass plain data instead."
    )
    raise SpecError(msg)


def _path(where: Any) -> str:
    parts: list[str] = []
    while isinstance(where, tuple):
        where, suffix = cast("tuple[Any, str]", where)
        parts.append(suffix)
    return where + "".join(reversed(parts))


def _items(xs: Any, where: Any, depth: int) -> list[Any]:
    return [_enc(v, (where, f"[{k}]"), depth) for k, v in enumerate(xs)]


def _pairs(d: Any, where: Any, depth: int) -> list[Any]:
    return [e for k, v in d.items() for e in (_enc(k, (where, " key"), depth), _enc(v, (where, f"[{k!r}]"), depth))]


def _record_fields(x: Any, where: Any, depth: int) -> list[Any]:
    name = _record_names()[type(x)]
    return [name, *_items(_fields(x), (where, f".{name}"), depth)]


def _fields(x: Any) -> tuple[Any, ...]:
    if isinstance(x, tuple):
        return tuple(cast("tuple[Any, ...]", x))
    return tuple(getattr(x, f) for f in x.__dataclass_fields__)


def _named_tuple(x: tuple[Any, ...], where: Any, depth: int) -> list[Any]:
    cls = type(x)
    return [cls.__module__, cls.__qualname__, *_items(x, where, depth)]


def _tree(spec: Any, where: Any, depth: int) -> list[Any]:
    # The structure travels as an instance of itself with 0 at every leaf.
    example = optree.tree_unflatten(spec, [0] * spec.num_leaves)
    return [spec.none_is_leaf, spec.namespace, _enc(example, (where, " (a tree structure)"), depth)]


def _exception(x: BaseException, where: Any, depth: int) -> list[Any]:
    name = type(x).__name__
    args = list(x.args) if all(type(a) in _SCALARS for a in x.args) else [str(x)]
    if _ERRORS.get(name) is not type(x):
        name, args = "RuntimeError", [f"{name}: {x}"]
    notes = [str(n) for n in getattr(x, "__notes__", ())]
    return [name, args, notes]


def _is_named_tuple(x: Any) -> bool:
    if not isinstance(x, tuple):
        return False
    t = cast("tuple[Any, ...]", x)
    return hasattr(type(t), "_fields") or optree.is_structseq(t)


_ENCODERS: list[tuple[str, Callable[[Any], bool], _Encoder]] = [
    ("dtype", lambda x: isinstance(x, torch.dtype), lambda x, w, d: [str(x).removeprefix("torch.")]),
    ("size", lambda x: isinstance(x, torch.Size), lambda x, w, d: [int(n) for n in x]),
    ("device", lambda x: isinstance(x, torch.device), lambda x, w, d: [str(x)]),
    ("layout", lambda x: isinstance(x, Layout), lambda x, w, d: [x.to_dict()]),
    ("record", lambda x: type(x) in _record_names(), _record_fields),
    ("t", lambda x: type(x) is tuple, _items),
    ("nt", _is_named_tuple, _named_tuple),
    ("l", lambda x: type(x) is list, _items),
    ("d", lambda x: type(x) is dict, _pairs),
    ("od", lambda x: type(x) is collections.OrderedDict, _pairs),
    ("s", lambda x: type(x) is set, lambda x, w, d: _items(sorted(x, key=repr), w, d)),
    ("fs", lambda x: type(x) is frozenset, lambda x, w, d: _items(sorted(x, key=repr), w, d)),
    ("c", lambda x: type(x) is complex, lambda x, w, d: [x.real, x.imag]),
    ("b", lambda x: type(x) is bytes, lambda x, w, d: [x.hex()]),
    ("tree", lambda x: isinstance(x, optree.PyTreeSpec), _tree),
    ("exc", lambda x: isinstance(x, BaseException), _exception),
]


_EXACT: dict[type[Any], tuple[str, _Encoder]] = {
    tuple: ("t", _items),
    list: ("l", _items),
    dict: ("d", _pairs),
    torch.dtype: ("dtype", _ENCODERS[0][2]),
}


def _records() -> dict[str, type]:
    """The records that ranks exchange, by name.

    Layout values, this codec's own, and those that the modules exchanging them registered
    (``fshard._base.records``).
    """
    return _known(count())


def _record_names() -> dict[type, str]:
    return _names(count())


@functools.cache
def _known(registered: int) -> dict[str, type]:
    return {"ShardMeta": ShardMeta, "Placement": Placement, "Unsendable": Unsendable, **records()}


@functools.cache
def _names(registered: int) -> dict[type, str]:
    return {cls: name for name, cls in _known(registered).items()}


# -- decoding (untrusted input) -----------------------------------------------------


def _dec(x: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")
    if type(x) in _SCALARS:
        return x
    xs = cast("list[Any]", x)  # JSON: a list, else refused next
    if type(xs) is not list or not xs or type(xs[0]) is not str or xs[0] not in _DECODERS:
        raise ValueError(f"not an encoded value: {str(xs)[:80]}")
    return _DECODERS[xs[0]](xs[1:], depth + 1)


def _all(xs: list[Any], depth: int) -> list[Any]:
    return [_dec(v, depth) for v in xs]


def _dict(xs: list[Any], depth: int, kind: type = dict) -> Any:
    if len(xs) % 2:
        raise ValueError("a dict with an odd number of keys and values")
    vs = _all(xs, depth)
    return kind(zip(vs[::2], vs[1::2]))


def _dtype(xs: list[Any], depth: int) -> torch.dtype:
    (name,) = xs
    dtype = getattr(torch, name, None) if type(name) is str else None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"not a torch dtype: {str(name)[:40]!r}")
    return dtype


def _str(xs: list[Any]) -> str:
    (s,) = xs
    if type(s) is not str:
        raise TypeError(f"expected a string, got {type(s).__name__}")
    return s


def _record(xs: list[Any], depth: int) -> Any:
    name, *fields = xs
    cls = _records().get(name) if type(name) is str else None
    if cls is None:
        raise ValueError(f"not an fshard record: {str(name)[:40]!r}")
    return cls(*_all(fields, depth))


def _named(xs: list[Any], depth: int) -> tuple[Any, ...]:
    module, qualname, *items = xs
    cls = _loaded_type(module, qualname)
    if optree.is_structseq_class(cls):
        return cls(_all(items, depth))
    if not (hasattr(cls, "_fields") and issubclass(cls, tuple)):
        raise ValueError(f"{module}.{qualname} is not a named tuple")
    return cast("tuple[Any, ...]", cls(*_all(items, depth)))


def _loaded_type(module: Any, qualname: Any) -> type:
    """A class of a module this process has imported already (nothing is imported, no hook runs)."""
    obj: Any = sys.modules.get(module) if type(module) is str else None
    for part in qualname.split(".") if type(qualname) is str and obj is not None else ["?"]:
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
    if not isinstance(obj, type):
        raise TypeError(f"no class {str(module)[:60]}.{str(qualname)[:60]} is loaded on this rank")
    return obj


def _tree_spec(xs: list[Any], depth: int) -> Any:
    none_is_leaf, namespace, example = xs
    if type(none_is_leaf) is not bool or type(namespace) is not str:
        raise TypeError("a tree structure's flags are not a bool and a str")
    value = _dec(example, depth)
    if any(leaf != 0 for leaf in optree.tree_leaves(value, none_is_leaf=none_is_leaf)):
        raise ValueError("a tree structure's example has leaves other than 0")
    return optree.tree_structure(value, none_is_leaf=none_is_leaf, namespace=namespace)


def _error(xs: list[Any], depth: int) -> BaseException:
    name, args, notes = xs
    cls = _ERRORS.get(name) if type(name) is str else None
    if cls is None or type(args) is not list or type(notes) is not list:
        raise ValueError(f"not an allowed exception: {str(name)[:40]!r}")
    args, notes = cast("list[Any]", args), cast("list[Any]", notes)
    if not all(type(a) in _SCALARS for a in args) or not all(type(n) is str for n in notes):
        raise TypeError("an exception's arguments and notes must be plain scalars")
    try:
        exc = cls(*args)
    except Exception:  # a constructor that wants other arguments: keep the text
        exc = RuntimeError(f"{name}: {args}")
    for note in notes:
        exc.add_note(note)
    return exc


def _layout(xs: list[Any], depth: int) -> Layout:
    (data,) = xs
    if type(data) is not dict:
        raise TypeError("a layout is not a dict")
    return Layout.from_dict(cast("dict[str, Any]", data))


_DECODERS: dict[str, _Decoder] = {
    "dtype": _dtype,
    "size": lambda xs, d: torch.Size([n for n in xs if type(n) is int or _bad("a size holds a non-int")]),
    "device": lambda xs, d: torch.device(_str(xs)),
    "layout": _layout,
    "record": _record,
    "t": lambda xs, d: tuple(_all(xs, d)),
    "nt": _named,
    "l": _all,
    "d": _dict,
    "od": lambda xs, d: _dict(xs, d, collections.OrderedDict),
    "s": lambda xs, d: set(_all(xs, d)),
    "fs": lambda xs, d: frozenset(_all(xs, d)),
    "c": lambda xs, d: complex(*(v if type(v) in (int, float) else _bad("a complex of non-numbers") for v in xs)),
    "b": lambda xs, d: bytes.fromhex(_str(xs)),
    "tree": _tree_spec,
    "exc": _error,
}


def _bad(why: str) -> bool:
    raise ValueError(why)
