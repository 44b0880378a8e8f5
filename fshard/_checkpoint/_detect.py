"""Which kind of checkpoint a path holds: fshard's own, a Hugging Face file or folder, or a torch DCP folder."""

from __future__ import annotations

from pathlib import Path

from fshard._checkpoint._dcp_meta import METADATA
from fshard._checkpoint._format import INDEX
from fshard._errors import CheckpointError

__all__ = ["HF_INDEX", "HF_SINGLE", "checkpoint_kind"]

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"  # a folder's one file, read before an index (as transformers does)


def checkpoint_kind(root: Path) -> str:
    """``"fshard"``, ``"hf-file"``, ``"hf-folder"`` or ``"dcp"``: what ``load`` reads at ``root``.

    A file is a safetensors file; a folder with ``index.json`` is fshard's, one with
    ``.metadata`` torch DCP's, one with ``model.safetensors.index.json`` or top-level
    ``.safetensors`` files Hugging Face's. Anything else counts as fshard's, whose loader
    names what is missing.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = (Path(d) / ".metadata").write_bytes(b"")
    ...     checkpoint_kind(Path(d))
    'dcp'
    """
    try:
        if root.is_file():
            if root.name in (INDEX, HF_INDEX, METADATA):
                msg = (
                    f"Checkpoint path {root} is the index of the checkpoint in {root.parent}, not a checkpoint: "
                    f"pass that folder, fshard.load({str(root.parent)!r})."
                )
                raise CheckpointError(msg)
            return "hf-file"
        if not root.is_dir() or (root / INDEX).exists():
            return "fshard"
        if (root / METADATA).is_file():
            return "dcp"
        if (root / HF_INDEX).is_file() or any(p.suffix == ".safetensors" and p.is_file() for p in root.iterdir()):
            return "hf-folder"
    except OSError as exc:
        raise CheckpointError(f"Checkpoint path {root} cannot be read: {exc.strerror or exc}.") from exc
    return "fshard"
