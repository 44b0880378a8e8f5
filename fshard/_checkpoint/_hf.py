"""``fshard.load`` of a Hugging Face safetensors file or folder into target layouts (collective).

Two steps, so that a failure anywhere raises everywhere and nothing hangs:

1. every rank reads and checks every header, applies ``rename``/``fuse``, resolves the
   targets and plans the reads (``_hf_plan``), then reads the boxes it was given, only
   their byte ranges, into new buffers; one exchange then tells every rank whether any
   rank failed, and compares a digest of the ranks' plans;
2. one ``reshard`` of the load's byte array sends each replicated box from its reader
   to its other holders; each rank then views its bytes as its shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from fshard._api.move import reshard
from fshard._array.array import ShardedArray
from fshard._base.alloc import new
from fshard._checkpoint._collective import agree_on, progress_bar
from fshard._checkpoint._fuse import View, apply_fuse, rename_all
from fshard._checkpoint._hf_files import Source, catalog
from fshard._checkpoint._hf_plan import ReadPlan, plan_reads
from fshard._checkpoint._ranges import Runs, byte_view, coalesce, read_runs, runs
from fshard._checkpoint._safetensors import Header
from fshard._errors import CheckpointError, SpecError
from fshard._layout.layout import Layout
from fshard._layout.specs import Replicated, as_layout
from fshard.backends import Backend

__all__ = ["load_hf"]


_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class _Want:
    """One array to return: its view of the checkpoint, target layout and dtype; ``device`` for a plain tensor."""

    name: str
    view: View
    layout: Layout
    dtype: torch.dtype
    device: torch.device | None = None
    requires_grad: bool = False


@dataclasses.dataclass(frozen=True)
class _Prepared:
    sources: dict[str, Source]
    wants: list[_Want]
    plan: ReadPlan
    digest: str


def load_hf(root: Path, kind: str, like: Any, specs: Any, options: dict[str, Any], coord: Backend) -> dict[str, Any]:
    """The arrays of the checkpoint at ``root`` that ``like`` or ``specs`` ask for, by name.

    ``options``: ``dtype``, ``rename``, ``fuse``, ``backend`` and ``progress`` of ``fshard.load``.
    """
    if like is None and specs is None:
        msg = (
            f"load() of the Hugging Face checkpoint {root} needs specs= (a mapping of names to specs, or a function "
            "(name, shape, dtype) -> spec or None) or like= (a mapping of names to arrays): it holds no layouts."
        )
        raise TypeError(msg)
    dtype = options["dtype"]
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"load() dtype= takes a torch.dtype or None, got {dtype!r}.")

    def prepare_and_read() -> tuple[_Prepared, list[torch.Tensor]]:
        prepared = _prepare(root, kind, like, specs, options, coord)
        with progress_bar("fshard.load", _bytes_here(prepared, coord), options["progress"], coord) as bar:
            return prepared, _read_boxes(prepared, coord, bar)

    (prepared, data), seen = agree_on(coord, "fshard.load", prepare_and_read, lambda out: out[0].digest)
    if len(set(seen)) > 1:
        msg = (
            f"fshard.load of {root}: the ranks read different checkpoints or targets; give every rank the same "
            "files and arguments."
        )
        raise CheckpointError(msg)
    return _assemble(prepared, data, coord)


def _prepare(root: Path, kind: str, like: Any, specs: Any, options: dict[str, Any], coord: Backend) -> _Prepared:
    sources = catalog(root, kind)
    views = {name: View.whole(name, s.entry.shape, s.entry.dtype) for name, s in sources.items()}
    views = apply_fuse(rename_all(views, options["rename"]), options["fuse"])
    if like is not None:
        wants = _wants_like(views, like, options["dtype"], coord)
    else:
        wants = _wants_specs(views, specs, options["dtype"], options["backend"] or coord)
    plan = plan_reads([w.layout for w in wants], [w.view.dtype.itemsize for w in wants])
    return _Prepared(sources, wants, plan, _digest(sources, wants))


def _missing(names: list[str], views: dict[str, View], given: str) -> CheckpointError:
    shown = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
    return CheckpointError(
        f"load() {given} names {shown}, which the checkpoint does not hold (after rename= and fuse=; it holds "
        f"{len(views)} tensors, e.g. {list(views)[:3]})."
    )


def _wants_specs(views: dict[str, View], specs: Any, dtype: torch.dtype | None, backend: Backend) -> list[_Want]:
    if isinstance(specs, Mapping):
        table: Mapping[Any, Any] = specs  # pyright: ignore[reportUnknownVariableType]
        missing = [str(k) for k in table if k not in views]
        if missing:
            raise _missing(missing, views, "specs=")
        pick: Callable[[str, tuple[int, ...], torch.dtype], Any] = lambda name, shape, dt: table.get(name)  # noqa: E731
    elif callable(specs):
        pick = specs
    else:
        pick = lambda name, shape, dt: specs  # noqa: E731
    out: list[_Want] = []
    for name, view in views.items():
        spec = pick(name, view.shape, view.dtype)
        if spec is None:
            continue
        try:
            layout = as_layout(spec, view.shape)
        except SpecError as exc:
            raise SpecError(f"Tensor {name!r} ({view.dtype}, shape {view.shape}): {exc}") from None
        _check_not_partial(name, layout)
        backend.check_layout(layout)
        out.append(_Want(name, view, layout, dtype or view.dtype))
    return out


def _wants_like(views: dict[str, View], like: Any, dtype: torch.dtype | None, coord: Backend) -> list[_Want]:
    if not isinstance(like, Mapping):
        raise TypeError(
            f"load() like= of a Hugging Face checkpoint takes a mapping of names, got {type(like).__name__}."
        )
    given: Mapping[Any, Any] = like  # pyright: ignore[reportUnknownVariableType]
    missing = [str(k) for k in given if k not in views]
    if missing:
        raise _missing(missing, views, "like=")
    ranks: tuple[int, ...] = getattr(coord, "ranks", (0,))
    out: list[_Want] = []
    for name, view in views.items():
        if name not in given:
            continue
        x = given[name]
        if not isinstance(x, (ShardedArray, torch.Tensor)):
            raise TypeError(f"load() like= gives a {type(x).__name__} for {name!r}: give a ShardedArray or a tensor.")
        if tuple(x.shape) != view.shape:
            raise CheckpointError(
                f"Tensor {name!r} of the checkpoint has shape {view.shape}, like= has {tuple(x.shape)}."
            )
        if isinstance(x, ShardedArray):
            if x.backend != coord:
                raise SpecError(f"load() like= holds {name!r} on backend {x.backend!r}, others on {coord!r}: use one.")
            _check_not_partial(name, x.layout)
            out.append(_Want(name, view, x.layout, dtype or x.dtype, requires_grad=x.requires_grad))
        else:
            layout = Replicated(list(ranks)).layout(view.shape)
            out.append(_Want(name, view, layout, dtype or x.dtype, x.device, x.requires_grad))
    return out


def _check_not_partial(name: str, layout: Layout) -> None:
    if layout.partial is not None:
        msg = (
            f"Tensor {name!r}: the target layout has a pending {layout.partial} (partial={layout.partial!r}), but "
            "a checkpoint holds values, not summands: load into the spec without Partial(...)."
        )
        raise SpecError(msg)


def _digest(sources: dict[str, Source], wants: list[_Want]) -> str:
    h = hashlib.sha256()
    for w in wants:
        pieces = [(p, sources[p.source].header.path.name, sources[p.source].entry.begin) for p in w.view.pieces]
        h.update(repr((w.name, w.view.shape, str(w.view.dtype), w.view.dim, pieces, str(w.dtype))).encode())
        cols = w.layout.columns
        for part in (cols.lo.tobytes(), cols.sz.tobytes(), cols.rank.tobytes(), repr(cols.devices).encode()):
            h.update(part)
    return h.hexdigest()


def _bytes_here(prepared: _Prepared, coord: Backend) -> int:
    reader = prepared.plan.reader
    return 0 if reader is None else sum(reader.shards[i].numel for i in coord.addressable(reader))


class _Files:
    """Data files opened on first use and checked to be the files whose headers were read."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack, self.fds = stack, dict[Path, int]()

    def fd(self, header: Header) -> int:
        fd = self.fds.get(header.path)
        if fd is None:
            try:
                fd = os.open(header.path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise CheckpointError(
                    f"Safetensors file {header.path} cannot be opened: {exc.strerror or exc}."
                ) from None
            self.stack.callback(os.close, fd)
            info = os.fstat(fd)
            if (info.st_size, (info.st_dev, info.st_ino, info.st_mtime_ns)) != (header.size, header.identity):
                msg = (
                    f"Safetensors file {header.path} changed since its header was read: load again once it is written."
                )
                raise CheckpointError(msg)
            self.fds[header.path] = fd
        return fd


def _box_runs(
    view: View, offsets: tuple[int, ...], sizes: tuple[int, ...], sources: dict[str, Source]
) -> list[tuple[Source, Runs]]:
    """Per piece of ``view`` that the box meets: its source and runs (absolute file offsets, box buffer offsets)."""
    out: list[tuple[Source, Runs]] = []
    d = view.dim
    for p, at in zip(view.pieces, view.starts()):
        lo, hi = (max(offsets[d], at), min(offsets[d] + sizes[d], at + p.sizes[d])) if sizes else (0, 1)
        if lo >= hi:
            continue
        sub_at = (*offsets[:d], lo, *offsets[d + 1 :]) if sizes else ()
        sub_sz = (*sizes[:d], hi - lo, *sizes[d + 1 :]) if sizes else ()
        t_at = tuple(o + s - (at if k == d else 0) for k, (o, s) in enumerate(zip(p.offsets, sub_at)))
        b_at = tuple(s - o for s, o in zip(sub_at, offsets))
        src = sources[p.source]
        f, b, n = runs(src.entry.shape, t_at, sub_sz, sizes, b_at, view.dtype.itemsize)
        out.append((src, (f + src.entry.begin, b, n)))
    return out


def _read_boxes(prepared: _Prepared, coord: Backend, bar: Any) -> list[torch.Tensor]:
    """This process's reader shards: each box's bytes, read from its files only where it lies."""
    reader = prepared.plan.reader
    if reader is None:
        return []
    out: list[torch.Tensor] = []
    with contextlib.ExitStack() as stack:
        files = _Files(stack)
        for i in coord.addressable(reader):
            a, offsets, sizes = prepared.plan.boxes[i]
            w = prepared.wants[a]
            buf = new(sizes, w.view.dtype, _CPU)
            into = byte_view(buf)
            for src, spans in _grouped(_box_runs(w.view, offsets, sizes, prepared.sources)):
                read_runs(files.fd(src.header), src.header.path, f"tensor {src.entry.name!r}", 0, spans, into)
            data = buf.reshape(-1).view(torch.uint8)
            device = torch.device(reader.shards[i].placement.device)
            out.append(data if device.type == "cpu" else data.to(device))
            bar.update(buf.nbytes)
    return out


def _grouped(parts: list[tuple[Source, Runs]]) -> list[tuple[Source, Runs]]:
    """Consecutive pieces in one file as one set of runs, merged where they touch."""
    out: list[tuple[Source, list[Runs]]] = []
    for src, spans in parts:
        if out and out[-1][0].header.path == src.header.path:
            out[-1][1].append(spans)
        else:
            out.append((src, [spans]))
    return [(src, coalesce(spans)) for src, spans in out]


def _typed(data: torch.Tensor, dtype: torch.dtype, sizes: tuple[int, ...]) -> torch.Tensor:
    try:
        return data.view(dtype).view(sizes)
    except RuntimeError:  # a buffer at an offset that the wider dtype cannot start at
        return data.clone().view(dtype).view(sizes)


def _assemble(prepared: _Prepared, data: list[torch.Tensor], coord: Backend) -> dict[str, Any]:
    plan = prepared.plan
    moved: dict[int, torch.Tensor] = {}
    if plan.reader is not None and plan.target is not None:
        array = ShardedArray(plan.reader, data, coord, torch.uint8)
        moved = dict(zip(coord.addressable(plan.target), reshard(array, plan.target).addressable_data))
    out: dict[str, Any] = {}
    for a, w in enumerate(prepared.wants):
        tensors: list[torch.Tensor] = []
        for i in coord.addressable(w.layout):
            meta = w.layout.shards[i]
            row = plan.row(a, i)
            if row is None:
                t = torch.empty(meta.sizes, dtype=w.dtype, device=torch.device(meta.placement.device))
            else:
                t = _typed(moved[row], w.view.dtype, meta.sizes).to(w.dtype)
            t = t if w.device is None else t.to(w.device)
            tensors.append(t.requires_grad_() if w.requires_grad else t)
        if w.device is not None:
            out[w.name] = tensors[0]
        else:
            out[w.name] = ShardedArray(w.layout, tensors, coord, w.dtype, requires_grad=w.requires_grad)
    return out
