"""What an inference part was predicted from: its input file's size, mtime and a hash of its
Parquet footer (which holds every row group's offsets, sizes and statistics), recorded in the
part's metadata so that a rerun redoes the parts of an input rewritten since."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq

from pipelines.parquet_files import footer_sha256

METADATA_KEY = b"torchrec_tpu.input"
FOOTER_FIELD = "footer_sha256="


def input_identity(path: str | Path) -> str:
    """``size=... mtime_ns=... footer_sha256=...`` of the Parquet file ``path``."""
    with open(path, "rb") as file:
        stat = os.fstat(file.fileno())
        digest = footer_sha256(file)
    return f"size={stat.st_size} mtime_ns={stat.st_mtime_ns} {FOOTER_FIELD}{digest}"


def footer_of(identity: str) -> str:
    """The footer hash of an :func:`input_identity` string (the file's content identity)."""
    return identity.rpartition(FOOTER_FIELD)[2]


def recorded_identity(part: Path) -> str | None:
    """The input identity a part was written with (None: written before identities were kept)."""
    value = (pq.read_schema(part).metadata or {}).get(METADATA_KEY)
    return value.decode() if value is not None else None
