"""The files of an HSTU checkpoint (``torchrec-tpu train --model hstu|dlrmv4``, :mod:`torchrec_tpu.hstu.train`),
named here without importing the model: ``<root>/step-N/`` holds, per rank R, ``dense-rank-R.pt``
(the STU stack and heads, Adam, the data position) and ``tables-rank-R.pt`` (R's table shards and
optimizer slots), then ``meta.json`` (written last: world size, position and the model record
under :data:`HSTU_META`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HSTU_META = "hstu"  # meta.json's record of the model (HSTUConfig.to_dict): what marks an HSTU checkpoint
META_FILE = "meta.json"


def dense_file(rank: int) -> str:
    return f"dense-rank-{rank:03d}.pt"


def tables_file(rank: int) -> str:
    return f"tables-rank-{rank:03d}.pt"


def latest_hstu_checkpoint(root: Path) -> Path | None:
    """The newest ``step-N/`` of ``root`` whose ``meta.json`` was written (the last file a save writes)."""
    found = sorted(p for p in Path(root).glob("step-*") if (p / META_FILE).exists())
    return found[-1] if found else None


def hstu_meta(directory: Path) -> dict[str, Any] | None:
    """``directory``'s meta.json when it is an HSTU checkpoint's, else None."""
    try:
        meta = json.loads((Path(directory) / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get(HSTU_META), dict) else None


def find_hstu_checkpoint(path: Path) -> Path | None:
    """``path`` when it is an HSTU checkpoint, or the newest of a checkpoint root of them; None
    when it is neither (a DLRM checkpoint, say)."""
    path = Path(path)
    directory = path if (path / META_FILE).is_file() else latest_hstu_checkpoint(path) if path.is_dir() else None
    return directory if directory is not None and hstu_meta(directory) is not None else None
