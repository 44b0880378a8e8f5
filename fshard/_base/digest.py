"""Digests of tensor data: equal exactly when two tensors hold the same bytes, dtype and shape.

A digest reads the bits, not the values: ``-0.0`` and ``0.0`` differ, and so do two
NaNs with different payloads, as they would after any bitwise copy. Two kinds:

- ``"bytes"``: BLAKE2b over the tensor's bytes, read in place on the host (CPU tensors).
- ``"device"``: a hash computed with integer torch ops on the tensor's own device, so a
  CUDA tensor is read where it lives and only 16 bytes come back to the host. Every
  product is below 2**63 (no overflow, so no rounding or wrapping anywhere), so it gives
  the same digest on every device.

The two kinds give different digests for the same data: ranks that compare digests
agree on the kind first.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, cast

import torch

__all__ = ["Kind", "digest", "kind_of"]

Kind = Literal["bytes", "device"]

_P = (1 << 31) - 1  # a prime; x**5 permutes the integers mod _P, since 5 does not divide _P - 1
# Per lane: a position multiplier, an offset, and a weight for the word's quotient by _P (distinct).
_LANES = ((1_103_515_245, 12_345, 1_234_567_891), (2_147_483_629, 40_503, 987_654_323))
_CHUNK = 1 << 22  # 32-bit words hashed at once: a few 32 MiB int64 temporaries


def kind_of(tensor: torch.Tensor) -> Kind:
    """The kind that reads ``tensor`` where it lives: ``"bytes"`` on the CPU, else ``"device"``."""
    return "bytes" if tensor.device.type == "cpu" else "device"


def digest(tensor: torch.Tensor, kind: Kind | None = None) -> bytes:
    """A 16-byte digest of ``tensor``'s dtype, shape and bits (of ``kind``; default ``kind_of(tensor)``).

    >>> a, b = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    >>> a.equal(b), digest(a) == digest(b), digest(a) == digest(a.clone())
    (True, False, True)
    >>> digest(a, "device") == digest(a.double(), "device")
    False
    """
    with torch.no_grad(), torch._C._DisableFuncTorch():  # pyright: ignore[reportPrivateUsage]  # torch has no public form
        t = _stored(tensor)
        kind = kind_of(t) if kind is None else kind
        head = f"{kind} {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}".encode()
        h = hashlib.blake2b(head, digest_size=16)
        if t.device.type == "meta" or t.numel() == 0:
            return h.digest()
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        if kind == "bytes":
            h.update(flat.cpu().numpy().data)
        else:
            h.update(b"".join(v.to_bytes(4, "little") for v in _lanes(flat)))
        return h.digest()


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``tensor``'s data: outside torch.func wrappers, detached, views resolved.

    Called with torch.func transforms disabled, so what is read of it is not wrapped again.
    """
    functorch = cast("Any", torch._C)._functorch  # pyright: ignore[reportPrivateUsage]  # untyped in torch, no public form
    t = tensor
    while functorch.is_functorch_wrapped_tensor(t):
        t = cast("torch.Tensor", functorch.get_unwrapped(t))
    return t.detach().resolve_conj().resolve_neg()


def _lanes(flat: torch.Tensor) -> list[int]:
    """Two sums mod ``_P`` over the 32-bit words of ``flat`` (bytes), each word mixed with its position.

    Word ``w`` at position ``i`` adds ``x**5`` with ``x = (w mod P) + (w div P) * c + i * a + b``
    (mod P), where ``(a, b, c)`` differ per lane. ``x -> x**5`` permutes the residues (5 does
    not divide P - 1), and two words give the same ``x`` in both lanes only if they are equal
    (the lanes' ``c`` differ), so changing one word always changes a sum. Every product is
    below 2**63.
    """
    n = flat.numel()
    if n % 4 or flat.storage_offset() % 4:  # whole, aligned 32-bit words
        flat = torch.nn.functional.pad(flat, (0, -n % 4))
    words = flat.view(torch.int32)
    a, b, c = (torch.tensor(col, dtype=torch.int64, device=flat.device).unsqueeze(1) for col in zip(*_LANES))
    sums = torch.full((len(_LANES),), n % _P, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start : start + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        at = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device) % _P
        x = (w % _P + w // _P * c + (at * a + b) % _P) % _P  # (lanes, words)
        x2 = x * x % _P
        sums = (sums + (x2 * x2 % _P * x % _P).sum(dim=1)) % _P
    return [int(v) for v in sums.cpu().numpy()]  # 16 bytes back to the host
