"""Which kind of checkpoint a path holds: fshard's own, a torch DCP folder, or Hugging Face safetensors."""

from __future__ import annotations

from pathlib import Path

from fshard._checkpoint._dcp_meta import METADATA
from fshard._checkpoint._format import INDEX

__all__ = ["DCP", "FSHARD", "HF", "HF_INDEX", "checkpoint_format"]

FSHARD, DCP, HF = "fshard", "dcp", "hf"

HF_INDEX = "model.safetensors.index.json"


def checkpoint_format(root: Path) -> str:
    """``"fshard"`` (``index.json``), ``"dcp"`` (``.metadata``) or ``"hf"`` (safetensors files).

    Anything else counts as ``"fshard"``, so that reading it names what an fshard checkpoint lacks.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = (Path(d) / ".metadata").write_bytes(b"")
    ...     checkpoint_format(Path(d))
    'dcp'
    """
    if (root / INDEX).exists():
        return FSHARD
    if (root / METADATA).is_file():
        return DCP
    if root.suffix == ".safetensors" and root.is_file():
        return HF
    if (root / HF_INDEX).is_file() or (root.is_dir() and any(root.glob("*.safetensors"))):
        return HF
    return FSHARD
