"""What ``import fshard`` adds to ``import torch``: seconds and resident memory, in fresh processes.

Each round starts two interpreters, interleaved: one that imports torch alone, one that imports
torch and then fshard; each reports the seconds of its imports and how its resident memory grew
(``/proc/self/statm``, Linux) across the second.
Compiled bytecode is allowed (``PYTHONDONTWRITEBYTECODE`` is dropped from the environment, and
one untimed round writes it first), as in a user's installed environment. The row gives the
median over rounds of what fshard adds, against the target of at most 0.2 s and 10 MiB.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys

from .common import Row, Settings

__all__ = ["cases"]

TARGET_S, TARGET_MIB = 0.2, 10.0
_PROBE = (  # resident memory now, from /proc/self/statm (pages), before and after the import
    "import json, os, time\n"
    "def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
    "t = time.perf_counter(); import torch; torch_s = time.perf_counter() - t\n"
    "r = rss(); t = time.perf_counter()\n"
    "if {fshard}: import fshard\n"
    "extra_s = time.perf_counter() - t\n"
    "print(json.dumps([torch_s, extra_s, (rss() - r) / 1024]))\n"
)


def _probe(with_fshard: bool) -> tuple[float, float, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    code = _PROBE.format(fshard=with_fshard)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=300)
    torch_s, extra_s, extra_kib = json.loads(out.stdout)
    return torch_s, extra_s, extra_kib / 1024


@dataclasses.dataclass(frozen=True)
class ImportCase:
    """``import fshard`` after ``import torch``, against ``import torch`` alone."""

    group: str = "import"
    name: str = "import fshard after import torch"

    def run(self, settings: Settings) -> list[Row]:
        """Times ``settings.reps`` interleaved rounds (3 with ``--quick``) after one untimed round."""
        reps = 3 if settings.quick else settings.reps
        _probe(True)  # writes the bytecode
        alone: list[float] = []
        extra: list[float] = []
        mib: list[float] = []
        for _ in range(reps):
            alone.append(_probe(False)[0])
            _, seconds, grown = _probe(True)
            extra.append(seconds)
            mib.append(grown)
        added, memory = statistics.median(extra), statistics.median(mib)
        ok = added <= TARGET_S and memory <= TARGET_MIB
        note = f"+{memory:.1f} MiB resident over import torch (median of {reps})"
        target = f"<= +{TARGET_S} s and +{TARGET_MIB:.0f} MiB"
        return [
            Row(self.group, self.name, "import fshard (added)", added, reps=reps, target=target, ok=ok, note=note,
                samples=tuple(extra), peak_mib=memory),
            Row(self.group, self.name, "import torch", statistics.median(alone), reps=reps, samples=tuple(alone)),
        ]  # fmt: skip


def cases(settings: Settings) -> list[ImportCase]:
    """The one import case."""
    return [ImportCase()]
