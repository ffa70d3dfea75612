"""SparseCore data-layout facts shared by the engine (``sparsecore``) and the planner.

Values follow jax-tpu-embedding 0.1.0: rows and dims are padded to multiples of ``ALIGNMENT``;
ids travel as int32 and ``PADDING_ID`` (2^31-1) marks padding, so a table holds at most
``MAX_VOCAB`` rows; one SparseCore takes at most ``DEFAULT_MAX_IDS_PER_PARTITION`` ids from one
source SparseCore per step unless a table says otherwise.
"""

from __future__ import annotations

ALIGNMENT = 8
PADDING_ID = 2**31 - 1
MAX_VOCAB = PADDING_ID
DEFAULT_MAX_IDS_PER_PARTITION = 256
COMBINERS = ("sum", "mean", "sqrtn")


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple
