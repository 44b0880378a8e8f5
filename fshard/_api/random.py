"""Layout-invariant random numbers: each element is a hash of (seed, its global index).

A shard computes exactly its own elements, so ``gather(rand(spec, shape, seed=s))``
is bit-identical for every spec and world size, at no extra work per shard.
The hash is SplitMix64, computed with int64 tensor ops on the shard's device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["box_normal", "box_uniform", "draw_seed", "real_dtype"]

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MUL1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def _key(seed: int, stream: int) -> int:
    """A 64-bit key for (seed, stream), mixed on the CPU.

    The seed is hashed before the stream joins it, so no two (seed, stream) pairs are
    related: with a key of ``2 * seed + stream``, randn's angle stream of seed s would
    be rand's stream of seed s + 1.
    """
    bits = seed & 0xFFFFFFFFFFFFFFFF  # the seed's two's-complement bit pattern
    t = torch.tensor([bits - (1 << 64) if bits >> 63 else bits], dtype=torch.int64)
    return int(_mix(_mix(t) ^ stream)[0])


def _indices(shape: tuple[int, ...], lo: tuple[int, ...], size: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Row-major global linear indices of the box ``[lo, lo + size)``."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        axis = (torch.arange(size[d], dtype=torch.int64, device=device) + lo[d]) * stride
        idx = axis.reshape((-1,) + (1,) * (len(shape) - 1 - d)) + idx
        stride *= shape[d]
    return idx.expand(size) if not len(shape) else idx


def _bits(seed: int, stream: int, idx: torch.Tensor) -> torch.Tensor:
    return _mix(idx ^ _key(seed, stream))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _unit(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniform in [0, 1) with as many random bits as ``dtype`` can hold exactly."""
    mant = 1 - round(math.log2(torch.finfo(dtype).eps))  # significand bits: 24 for float32
    return _shr(bits, 64 - mant).to(_work_dtype(dtype)) * (2.0**-mant)


def box_uniform(
    seed: int, shape: Sequence[int], lo: Sequence[int], size: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Uniform [0, 1) values of the box ``[lo, lo + size)`` of a global array of ``shape``."""
    idx = _indices(tuple(shape), tuple(lo), tuple(size), device)
    return _unit(_bits(seed, 0, idx), dtype).to(dtype)


def box_normal(
    seed: int, shape: Sequence[int], lo: Sequence[int], size: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Standard normal values of the box (Box-Muller on two independent uniform streams)."""
    idx = _indices(tuple(shape), tuple(lo), tuple(size), device)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u1 = 1.0 - _unit(_bits(seed, 1, idx), torch.float64 if work == torch.float64 else torch.float32)
    u2 = _unit(_bits(seed, 2, idx), work)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)


def real_dtype(dtype: torch.dtype, what: str, inherited: bool = False) -> torch.dtype:
    """``dtype`` if it is a real floating point dtype, else ``TypeError`` naming ``what`` and the fix.

    ``inherited``: ``dtype`` is the array's own, not given (for the ``*_like`` functions).

    >>> real_dtype(torch.bfloat16, "rand()")
    torch.bfloat16
    """
    if dtype.is_floating_point:
        return dtype
    got = f"the array's dtype is {dtype}" if inherited else f"got dtype={dtype}"
    msg = f"{what} makes real floating point values, {got}: give dtype=torch.float32 (or float16, bfloat16, float64)."
    if dtype.is_complex:
        msg += (
            " For complex values make the real and imaginary parts as two real arrays (two seeds) "
            "and combine them: fshard.map_local(torch.complex, re, im)."
        )
    raise TypeError(msg)


def draw_seed() -> int:
    """A seed from torch's default generator, so ``torch.manual_seed`` makes runs repeatable."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
