"""Sizes with units, as people write them: 32GiB, 80GB, 512MiB, 25GB/s, 7.5e9, 175B."""

from __future__ import annotations

import re

_BYTES = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "PIB": 2**50,
}
_COUNT = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"


def parse_bytes(text: str, what: str = "size") -> int:
    """'32GiB' -> 34359738368. A bare number is refused: 32 could mean GB or GiB (7% apart)
    or bytes; the message names the fix."""
    match = re.fullmatch(rf"\s*{_NUMBER}\s*([A-Za-z]*)\s*", text)
    if match is None:
        raise ValueError(f"{what} {text!r} is not a size; write it like 32GiB or 80GB")
    number, unit = float(match.group(1)), match.group(2).upper()
    if not unit:
        raise ValueError(
            f"{what} {text!r} has no unit; write {text}GiB (2^30 bytes) or {text}GB (10^9 bytes)"
        )
    if unit not in _BYTES:
        raise ValueError(f"{what} {text!r}: unknown unit {match.group(2)!r}; use GiB, GB, MiB...")
    return round(number * _BYTES[unit])


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
    """'25GB/s' -> 2.5e10 bytes per second (the unit is required, '/s' optional)."""
    body = text.strip()
    body = body[:-2] if body.lower().endswith("/s") else body
    return float(parse_bytes(body, what))


def parse_count(text: str, what: str = "count") -> int:
    """'7.5e9', '7.5B', '175B', '1T' -> a number of things (B = billion here, not bytes)."""
    match = re.fullmatch(rf"\s*{_NUMBER}\s*([KMBTkmbt]?)\s*", text)
    if match is None:
        raise ValueError(f"{what} {text!r} is not a number; write it like 7.5e9 or 175B")
    return round(float(match.group(1)) * _COUNT[match.group(2).upper()])


def unit_bytes(unit: str) -> int:
    """Bytes in one `unit` (GiB: 2^30, GB: 10^9, ...)."""
    if unit.upper() not in _BYTES:
        raise ValueError(f"unknown unit {unit!r}; use GiB, GB, MiB...")
    return _BYTES[unit.upper()]


def format_count(n: float) -> str:
    """17.2B, 124.4M, 1.0T."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{suffix}"
    return f"{n:.0f}"
