"""Checkpoints: a pytree of arrays, tensors and scalars as safetensors files plus one JSON index.

On disk (format 1, described for other readers in docs/checkpoints.md)::

    path/index.json                              written last, atomically: the commit point
    path/data.<id>/rank-00003.safetensors        the boxes rank 3 wrote

Each distinct box is written once, by the replica that balances bytes across
ranks. ``load`` reads, per target shard on this process, only the byte ranges of
the saved boxes that overlap it (a whole saved box when it verifies hashes). No
pickle is written or read.

``load`` also reads Hugging Face safetensors files and folders (``_hf``), and
``save_safetensors`` writes them (``_hf_save``): see docs/interop.md.
"""

from fshard._checkpoint._format import FORMAT as FORMAT
from fshard._checkpoint._format import INDEX as INDEX
from fshard._checkpoint._format import MAX_DEPTH as MAX_DEPTH
from fshard._checkpoint._format import PROGRESS_MIN_BYTES as PROGRESS_MIN_BYTES
from fshard._checkpoint._format import VERSION as VERSION
from fshard._checkpoint._fuse import Concat as Concat
from fshard._checkpoint._fuse import Split as Split
from fshard._checkpoint._hf_save import save_safetensors as save_safetensors
from fshard._checkpoint._info import checkpoint_info as checkpoint_info
from fshard._checkpoint._load import load as load
from fshard._checkpoint._save import save as save

__all__ = [
    "FORMAT",
    "INDEX",
    "MAX_DEPTH",
    "PROGRESS_MIN_BYTES",
    "VERSION",
    "Concat",
    "Split",
    "checkpoint_info",
    "load",
    "save",
    "save_safetensors",
]
