"""What an inference part was predicted from: its input file's size, mtime and a hash of its
Parquet footer (which holds every row group's offsets, sizes and statistics), recorded in the
part's metadata so that a rerun redoes the parts of an input rewritten since."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow.parquet as pq

METADATA_KEY = b"torchrec_tpu.input"
_FOOTER_TAIL = 8  # a little-endian footer length, then b"PAR1"


def input_identity(path: str | Path) -> str:
    """``size=... mtime_ns=... footer_sha256=...`` of the Parquet file ``path``."""
    with open(path, "rb") as file:
        stat = os.fstat(file.fileno())
        tail_start = max(0, stat.st_size - _FOOTER_TAIL)
        file.seek(tail_start)
        footer_length = int.from_bytes(file.read(_FOOTER_TAIL)[:4], "little")
        file.seek(max(0, tail_start - footer_length))
        footer = file.read()
    digest = hashlib.sha256(footer).hexdigest()
    return f"size={stat.st_size} mtime_ns={stat.st_mtime_ns} footer_sha256={digest}"


def recorded_identity(part: Path) -> str | None:
    """The input identity a part was written with (None: written before identities were kept)."""
    value = (pq.read_schema(part).metadata or {}).get(METADATA_KEY)
    return value.decode() if value is not None else None
