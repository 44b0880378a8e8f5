"""Which kind of checkpoint a path holds: fshard's own, a Hugging Face file or folder, or a torch DCP folder."""

from __future__ import annotations

from pathlib import Path

from fshard._checkpoint._format import INDEX
from fshard._checkpoint._hf_files import HF_INDEX
from fshard._errors import CheckpointError

__all__ = ["checkpoint_kind"]


def checkpoint_kind(root: Path) -> str:
    """``"fshard"``, ``"hf-file"``, ``"hf-folder"`` or ``"dcp"``: what ``load`` reads at ``root``.

    A file is a safetensors file; a folder with ``index.json`` is fshard's; one with
    ``model.safetensors.index.json`` or top-level ``.safetensors`` files is Hugging Face's;
    one with ``.metadata`` is torch DCP's. Anything else is taken as fshard's, whose
    loader names what is missing.
    """
    try:
        if root.is_file():
            return "hf-file"
        if not root.is_dir() or (root / INDEX).exists():
            return "fshard"
        if (root / HF_INDEX).is_file():
            return "hf-folder"
        if (root / ".metadata").is_file():
            return "dcp"
        if any(p.suffix == ".safetensors" and p.is_file() for p in root.iterdir()):
            return "hf-folder"
    except OSError as exc:
        raise CheckpointError(f"Checkpoint path {root} cannot be read: {exc.strerror or exc}.") from exc
    return "fshard"
