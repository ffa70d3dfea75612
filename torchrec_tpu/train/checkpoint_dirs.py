"""Versioned checkpoint directories under one root, published by atomically moving ``latest``.

Layout::

    <root>/checkpoint.step-00000040.<tag>/   one checkpoint (contents: see checkpoint.py)
    <root>/latest -> checkpoint.step-00000040.<tag>

A save fills a new directory; :func:`publish` then writes its ``meta.json`` (the completion
mark), repoints ``latest`` with one rename (atomic on POSIX) and deletes all but the newest
``keep`` complete checkpoints plus the leftovers of interrupted saves. A process killed at any
moment leaves ``latest`` on a complete checkpoint. The tag, unique per save, keeps a retried save
of the same step out of the partial directory an interrupted one left.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

LATEST = "latest"
META_FILE = "meta.json"
_VERSION = re.compile(r"^checkpoint\.step-(\d{8,})\.[A-Za-z0-9-]+$")


def new_tag() -> str:
    """A tag no earlier save in any root used: UTC time plus random hex."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def version_dir(root: Path, step: int, tag: str) -> Path:
    return root / f"checkpoint.step-{step:08d}.{tag}"


def is_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a complete checkpoint (its ``meta.json`` was published)."""
    return (directory / META_FILE).is_file()


def resolve_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the checkpoint its ``latest`` points to."""
    if is_checkpoint(path):
        return path
    latest = path / LATEST
    if latest.is_symlink() and is_checkpoint(latest.resolve()):
        return latest.resolve()
    raise FileNotFoundError(
        f"{path} is not a checkpoint: expected {META_FILE} inside, or a '{LATEST}' link to a "
        "checkpoint directory (a checkpoint root written by --checkpoint-dir)"
    )


def publish(root: Path, directory: Path, meta: dict[str, Any], keep: int) -> None:
    """Mark ``directory`` complete, point ``root/latest`` at it, prune older checkpoints.

    Call once per save, on one process, after every rank finished writing ``directory``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the checkpoint just written), got {keep}")
    _write_durably(directory / META_FILE, json.dumps(meta, indent=2))
    _fsync_dir(directory)
    link = root / f".{LATEST}.{directory.name}"
    link.unlink(missing_ok=True)
    link.symlink_to(directory.name)
    os.replace(link, root / LATEST)
    _fsync_dir(root)
    _prune(root, directory, keep)


def _prune(root: Path, current: Path, keep: int) -> None:
    """Keep the ``keep`` most recently published checkpoints (``current`` among them); delete
    older ones and directories of saves that never completed."""
    versions = [p for p in root.iterdir() if _VERSION.match(p.name) and p.is_dir() and not p.is_symlink()]
    # newest published first; file times are coarse (a few ms), so the step breaks ties
    complete = sorted((p for p in versions if is_checkpoint(p)),
                      key=lambda p: (p == current, (p / META_FILE).stat().st_mtime_ns,
                                     int(_VERSION.match(p.name).group(1))), reverse=True)
    kept = set(complete[:keep])
    for path in versions:
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.*"):  # a link left by a save killed before its rename
        stale.unlink(missing_ok=True)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
