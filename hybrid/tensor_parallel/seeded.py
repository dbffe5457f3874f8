"""Counter-based normal random numbers: element i of parameter `name` is a pure function of
(seed, name, i), so a rank draws exactly the elements it keeps and nothing else.

Why counter-based (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"; JAX's
partitionable threefry): initialising every parameter from one seed, as Megatron-LM does,
makes a model at any tp and dp start from the tp=1 weights, but with a sequential generator
a rank must draw the whole tensor to reach its slice. At Turing-NLG scale (17B parameters,
256 ranks) every rank would draw all 17B values to keep 67M. A counter-based generator
hashes the index instead: any subset of elements costs only that subset, in any order,
split across any number of calls.

torch cannot do this itself: its CPU generators are mt19937 (no skip-ahead: reaching
element i costs i draws), and its CUDA generator, though counter-based (Philox), maps
counters to elements by the kernel's launch shape and runs only on a GPU. So this is a
small one in torch ops, vectorised:
- keys: four 32-bit words of sha256(f"{seed}:{name}");
- per element two 32-bit words from the "lowbias32" multiply-xorshift hash (C. Wellons,
  hash-prospector), each from its own pair of keys, mixing the index's low 32 bits, then
  its high 32 bits, in two rounds;
- Box-Muller in float64: z = sqrt(-2 ln u1) cos(2 pi u2), u1 in (0, 1], u2 in [0, 1),
  then rounded to float32.

Note (bitwise equal on every rank and every host): integers live in int64 tensors holding
values in [0, 2^32); each 32x32-bit multiply mod 2^32 splits the constant into 16-bit
halves, so no intermediate exceeds 2^49 and int64 never overflows. ln and cos are written
here from +, -, *, / and sqrt, which IEEE 754 rounds exactly in SIMD and scalar code
alike, rather than taken from torch.log / torch.cos, whose last bits are not specified
(MKL's, SLEEF's or libm's, chosen by the build and the CPU). Work is done in chunks on
the CPU, so temporaries stay bounded and no accelerator's math enters; a caller moves the
result to its parameter's device.

Cost: about 150 elementwise torch ops per element (~130 ns of one CPU core; torch.randn
takes ~5), paid only for the elements a rank keeps.
"""

from __future__ import annotations

import hashlib
import math

import torch

# Elements per pass and thread: each temporary (8 bytes an element) stays in a core's cache,
# and every torch op runs as a whole pass over it, so the op count sets the speed.
CHUNK_PER_THREAD = 1 << 16
_MASK32 = 0xFFFFFFFF
_TWO32 = 1 << 32
_LN2 = math.log(2.0)
_SQRT_HALF = math.sqrt(0.5)
# ln f = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), s = (f - 1)/(f + 1), |s| <= 0.172 for f
# in [sqrt(1/2), sqrt(2)): terms to s^23 leave an error below 1e-18.
_ATANH = [1.0 / (2 * k + 1) for k in range(12)]
# cos a = sum (-1)^k a^2k / (2k)! on [0, pi/2]: terms to a^22 leave an error below 1e-19.
_COS = [(-1) ** k / math.factorial(2 * k) for k in range(12)]


def keys(seed: int, name: str) -> tuple[int, int, int, int]:
    """Four 32-bit keys of parameter `name`'s stream."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return tuple(int.from_bytes(digest[4 * k : 4 * k + 4], "little") for k in range(4))


def seeded_normal(seed: int, name: str, indices: torch.Tensor) -> torch.Tensor:
    """Standard normal values (float32, CPU, shaped like `indices`) of elements `indices`
    (flat row-major indices, >= 0, into the tp=1 tensor) of parameter `name`'s stream.
    Each value depends only on (seed, name, index): not on the other indices asked for."""
    k = keys(seed, name)
    flat = indices.detach().to("cpu", torch.int64).reshape(-1)
    if flat.numel() and int(flat.min()) < 0:
        raise ValueError(f"indices of {name} must be >= 0")
    out = torch.empty(flat.numel(), dtype=torch.float32)
    chunk = CHUNK_PER_THREAD * torch.get_num_threads()
    for start in range(0, flat.numel(), chunk):
        out[start : start + chunk] = _normal(k, flat[start : start + chunk])
    return out.view(indices.shape)


def _normal(k: tuple[int, int, int, int], index: torch.Tensor) -> torch.Tensor:
    lo, hi = index & _MASK32, index >> 32
    w1 = _mix(_mix(lo ^ k[0]) ^ hi ^ k[1])
    w2 = _mix(_mix(lo ^ k[2]) ^ hi ^ k[3])
    radius = torch.sqrt(-2.0 * _log_u1(w1))
    return (radius * _cos_turn(w2)).to(torch.float32)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32): x * (c_hi 2^16 + c_lo), the c_hi part reduced
    mod 2^16 before its shift, so every intermediate is below 2^49."""
    high = (x * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(high).bitwise_and_(_MASK32)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection of [0, 2^32) with low avalanche bias."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def _log_u1(w: torch.Tensor) -> torch.Tensor:
    """ln u1 for u1 = (w + 1) / 2^32 in (0, 1]: u1 = f 2^e exactly (frexp), f moved into
    [sqrt(1/2), sqrt(2)), then the atanh series for ln f."""
    f, e = torch.frexp((w + 1).to(torch.float64) / _TWO32)
    small = f < _SQRT_HALF
    f = torch.where(small, f * 2.0, f)
    e = (e - small.to(e.dtype)).to(torch.float64)
    s = (f - 1.0) / (f + 1.0)
    s2 = s * s
    series = torch.full_like(s2, _ATANH[-1])
    for c in reversed(_ATANH[:-1]):
        series.mul_(s2).add_(c)
    return 2.0 * s * series + e * _LN2


def _cos_turn(w: torch.Tensor) -> torch.Tensor:
    """cos(2 pi u2) for u2 = w / 2^32 in [0, 1): folded exactly, on the integer, to an
    angle in [0, pi/2] (cos is even, and cos(pi - a) = -cos a), then the Taylor series."""
    w = torch.where(w >= 1 << 31, _TWO32 - w, w)
    negative = w > 1 << 30
    w = torch.where(negative, (1 << 31) - w, w)
    angle = w.to(torch.float64) * (2.0 * math.pi / _TWO32)
    y = angle * angle
    series = torch.full_like(y, _COS[-1])
    for c in reversed(_COS[:-1]):
        series.mul_(y).add_(c)
    return torch.where(negative, -series, series)
