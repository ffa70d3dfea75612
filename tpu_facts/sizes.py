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
    if n <= minimum:
        return minimum
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step
