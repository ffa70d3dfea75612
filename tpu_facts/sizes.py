"""Sizes: the one ``GIB``, and the buckets a variable size is rounded up to so that a few
compiled programs (or buffers) serve every size."""

from __future__ import annotations

GIB = 1024**3


def power_of_two_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= ``n`` and >= ``minimum`` (``minimum`` itself when it is larger)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def quarter_bucket(n: int, minimum: int = 64) -> int:
    """``n`` rounded up to one of four sizes per power of two (at most 25% padding), at least
    ``minimum`` (a power of two >= 8; 64 by default: the sparsecore programs' smallest input)."""
    return _octave_bucket(n, minimum, 2)


def eighth_bucket(n: int, minimum: int = 8) -> int:
    """``n`` rounded up to one of eight sizes per power of two (at most 12.5% padding), at least
    ``minimum`` (a power of two >= 8)."""
    return _octave_bucket(n, minimum, 3)


def _octave_bucket(n: int, minimum: int, log2_sizes: int) -> int:
    """``n`` rounded up to one of 2 ** ``log2_sizes`` evenly spaced sizes per power of two, at least ``minimum``."""
    if n <= minimum:
        return minimum
    step = 1 << ((n - 1).bit_length() - 1 - log2_sizes)
    return -(-n // step) * step
