"""``import fshard`` loads nothing heavy that torch itself does not: no TorchDynamo, no DCP, no transformers."""

from __future__ import annotations

import subprocess
import sys


def test_import_fshard_does_not_import_torchdynamo_or_checkpoint_libraries():
    code = (
        "import sys, torch; before = set(sys.modules); import fshard; "
        "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.checkpoint', 'transformers', 'tqdm') "
        "if m in sys.modules and m not in before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
