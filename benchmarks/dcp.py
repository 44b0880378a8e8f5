"""torch DCP folders: ``fshard convert`` of a DCP folder, its time and its peak memory.

The model is ``TENSORS`` float32 matrices, ``--sizes`` MiB in all (default 512; 16 with
``--quick``), the first a quarter of the whole and the others equal: the largest tensor
is a quarter of the model. It is written once with ``dcp.save(..., no_dist=True)``, one
chunk per tensor. ``python -m fshard convert SRC DST`` then runs in a child process, once
to an fshard checkpoint and, for reference, as torch's ``dcp_to_torch_save`` (which builds
the whole state dict in memory). Each child's peak resident set comes from ``wait4``;
its growth is measured against a child that only imports fshard (or torch). The target:
``convert`` grows by at most the largest tensor + 128 MiB, never by the whole model.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import fshard

from .common import Row, Settings

__all__ = ["ConvertCase", "cases", "peak_rss_mib", "write_model"]

GROUP = "checkpoint: torch DCP"
TENSORS = 8
COLS = 1024
SLACK_MIB = 128


def write_model(folder: Path, mib: float) -> int:
    """A DCP folder of ``mib`` MiB of float32 matrices at ``folder``; returns the largest tensor's bytes."""
    import torch.distributed.checkpoint as dcp

    total_rows = max(TENSORS, int(mib * (1 << 20) / (COLS * 4)))
    big = total_rows // 4
    rest = max(1, (total_rows - big) // (TENSORS - 1))
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{k}.weight": torch.randn(big if k == 0 else rest, COLS, generator=g) for k in range(TENSORS)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return max(t.nbytes for t in state.values())


# Runs argv[2] as Python code with sys.argv = argv[3:], then writes the process's peak resident set
# (VmHWM, which exec resets; getrusage's ru_maxrss would count the parent's memory at fork) to argv[1].
_MEASURED = """
import atexit, sys
def _report(path=sys.argv[1]):
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(path, "w") as out:
        out.write(str(kib))
atexit.register(_report)
code, sys.argv = sys.argv[2], sys.argv[3:]
exec(code)
"""


def peak_rss_mib(code: str, *args: str) -> tuple[float, float]:
    """(seconds, peak resident set in MiB) of a fresh Python process running ``code`` with ``sys.argv = args``."""
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "peak"
        start = time.perf_counter()
        argv = [sys.executable, "-c", _MEASURED, str(report), code, *args]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if done.returncode:
            raise RuntimeError(f"{args} failed ({done.returncode}): {done.stderr[-2000:]}")
        return seconds, int(report.read_text()) / 1024


_CLI = "import runpy; runpy.run_module('fshard', run_name='__main__')"
_TORCH_SAVE = (
    "import sys, warnings; warnings.simplefilter('ignore');"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save;"
    "dcp_to_torch_save(sys.argv[0], sys.argv[1])"
)


@dataclasses.dataclass(frozen=True)
class ConvertCase:
    """``fshard convert`` of a DCP folder of ``mib`` MiB to an fshard checkpoint or a Hugging Face folder.

    Its time and peak memory.
    """

    mib: float
    to: str = "fshard"
    group: str = GROUP

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        target = "Hugging Face" if self.to == "hf" else "fshard"
        return f"convert DCP -> {target}, {self.mib:g} MiB float32"

    def run(self, settings: Settings) -> list[Row]:
        """Converts once per implementation (a child process each); one row each."""
        with tempfile.TemporaryDirectory(prefix="fshard-bench-dcp-") as d:
            root = Path(d)
            largest = write_model(root / "dcp", self.mib) / (1 << 20)
            _, base = peak_rss_mib("import fshard, fshard._convert")
            seconds, peak = peak_rss_mib(
                _CLI, "fshard", "convert", str(root / "dcp"), str(root / "out"), "--to", self.to
            )
            grew = peak - base
            target = f"growth <= largest tensor ({largest:.0f} MiB) + {SLACK_MIB} MiB"
            note = f"peak RSS {peak:.0f} MiB, import-only child {base:.0f} MiB, model {self.mib:g} MiB"
            rows = [
                Row(
                    self.group,
                    self.name,
                    "fshard convert",
                    seconds,
                    1,
                    target=target,
                    ok=grew <= largest + SLACK_MIB,
                    note=note,
                    size_mib=self.mib,
                    peak_mib=grew,
                    verified=_same(root),
                )
            ]
            if settings.peers and self.to == "fshard":
                shutil.rmtree(root / "out", ignore_errors=True)
                _, torch_base = peak_rss_mib("import torch.distributed.checkpoint.format_utils")
                t_seconds, t_peak = peak_rss_mib(_TORCH_SAVE, str(root / "dcp"), str(root / "model.pt"))
                rows.append(Row(self.group, self.name, "dcp_to_torch_save", t_seconds, 1, size_mib=self.mib,
                                peak_mib=t_peak - torch_base, note=f"peak RSS {t_peak:.0f} MiB"))  # fmt: skip
        return rows


def _same(root: Path) -> bool:
    a, b = fshard.load(root / "dcp"), fshard.load(root / "out")
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def cases(settings: Settings) -> list[Any]:
    """Convert cases to fshard and to Hugging Face at each of ``settings.sizes`` MiB (512; 16 with ``quick``)."""
    sizes = settings.sizes or ((16,) if settings.quick else (512,))
    return [ConvertCase(mib, to) for mib in sizes for to in ("fshard", "hf")]
