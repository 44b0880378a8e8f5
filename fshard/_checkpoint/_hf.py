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

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch

from fshard._api.move import reshard
from fshard._array.array import ShardedArray
from fshard._checkpoint._collective import agree_on, progress_bar
from fshard._checkpoint._fuse import View, apply_fuse, rename_all
from fshard._checkpoint._hf_files import Source, catalog
from fshard._checkpoint._hf_plan import ReadPlan, plan_reads
from fshard._checkpoint._hf_read import read_boxes
from fshard._checkpoint._hf_targets import Want, wants_like, wants_plain, wants_specs
from fshard._errors import CheckpointError
from fshard._layout.layout import layout_digest
from fshard.backends import Backend

__all__ = ["load_hf"]


@dataclasses.dataclass(frozen=True)
class _Prepared:
    sources: dict[str, Source]
    wants: list[Want]
    plan: ReadPlan
    digest: str


def load_hf(root: Path, kind: str, like: Any, specs: Any, options: dict[str, Any], coord: Backend) -> dict[str, Any]:
    """The arrays of the checkpoint at ``root`` that ``like`` or ``specs`` ask for, by name.

    ``options``: ``dtype``, ``rename``, ``fuse``, ``backend`` and ``progress`` of ``fshard.load``.
    """
    dtype = options["dtype"]
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"load() dtype= takes a torch.dtype or None, got {dtype!r}.")

    def prepare_and_read() -> tuple[_Prepared, list[torch.Tensor]]:
        prepared = _prepare(root, kind, like, specs, options, coord)
        with progress_bar("fshard.load", _bytes_here(prepared, coord), options["progress"], coord) as bar:
            return prepared, read_boxes(prepared.plan, prepared.wants, prepared.sources, coord, bar)

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
        wants = wants_like(views, like, options["dtype"], coord)
    elif specs is None:
        wants = wants_plain(views, options["dtype"], coord)
    else:
        wants = wants_specs(views, specs, options["dtype"], options["backend"] or coord)
    plan = plan_reads([w.layout for w in wants], [w.view.dtype.itemsize for w in wants])
    return _Prepared(sources, wants, plan, _digest(sources, wants))


def _digest(sources: dict[str, Source], wants: list[Want]) -> str:
    """What a rank reads: its files' samples of data, and each target's pieces and layout.

    Ranks whose digests differ read different checkpoints or targets (each would read its own
    bytes into boxes that others send on), so the load raises on every rank.
    """
    h = hashlib.sha256()
    for header in sorted({id(s.header): s.header for s in sources.values()}.values(), key=lambda x: x.path.name):
        h.update(repr((header.path.name, header.size)).encode())
        h.update(header.sample)
    for w in wants:
        pieces = [(p, sources[p.source].header.path.name, sources[p.source].entry.begin) for p in w.view.pieces]
        h.update(repr((w.name, w.view.shape, str(w.view.dtype), w.view.dim, pieces, str(w.dtype))).encode())
        h.update(layout_digest(w.layout))  # devices aside: each rank may name its own (cuda:{local_rank})
    return h.hexdigest()


def _bytes_here(prepared: _Prepared, coord: Backend) -> int:
    reader = prepared.plan.reader
    return 0 if reader is None else sum(reader.shards[i].numel for i in coord.addressable(reader))


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
