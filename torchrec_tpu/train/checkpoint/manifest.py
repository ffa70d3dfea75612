"""Integrity of one checkpoint directory: a sha256 manifest of its files, checked before loading.

``manifest.json`` lists every file of the checkpoint (path relative to the checkpoint directory,
size, sha256). It is written last, after every rank finished writing, so it is also the mark of a
complete checkpoint (see dirs.py). It detects corruption: a changed byte, a truncated
or lost file. It does not detect tampering, since whoever can write the files can rewrite the
manifest; that nothing in a crafted checkpoint can run code is the job of checkpoint_reader.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint is corrupt, incomplete, unsafe to load, or does not fit the run resuming it;
    the message names the checkpoint and the file or value."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_of(directory: Path) -> dict[str, Any]:
    """The manifest of every regular file under ``directory`` (the manifest itself excluded)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()):
        relative = path.relative_to(directory).as_posix()
        if relative != MANIFEST_FILE:
            files[relative] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return {"format": MANIFEST_FORMAT, "files": files}


def read_manifest(directory: Path, noun: str = "checkpoint") -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "sha256"}}`` from ``directory``'s manifest; CheckpointError
    (naming the directory as ``noun``: a checkpoint, an exported model) when it is missing or
    malformed."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{noun} {directory} has no {MANIFEST_FILE}: the save did not "
                              "complete, or an older torchrec-tpu wrote it")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest["format"] != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest['format']!r}")
        for name, entry in files.items():
            if not _is_inside(name) or not isinstance(entry["bytes"], int) \
                    or not isinstance(entry["sha256"], str):
                raise ValueError(f"bad entry {name!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{noun} {directory}: {MANIFEST_FILE} is corrupt ({error})") from None
    return files


def verify_checkpoint(directory: Path, required: tuple[str, ...] = (), noun: str = "checkpoint") -> None:
    """Check every file of ``directory``'s manifest (size, then sha256) and that the manifest
    lists ``required``; CheckpointError naming ``noun``, the directory and the first bad file."""
    files = read_manifest(directory, noun)
    for name in required:
        if name not in files:
            raise CheckpointError(f"{noun} {directory}: {MANIFEST_FILE} does not list {name}")
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{noun} {directory}: {name} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{noun} {directory}: {name} has {size} bytes, the manifest "
                                  f"says {entry['bytes']} (truncated or changed)")
        if file_sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{noun} {directory}: {name} is corrupt (its sha256 differs "
                                  "from the manifest's)")


def _is_inside(name: object) -> bool:
    """Whether a manifest path names a file inside the checkpoint directory."""
    if not isinstance(name, str) or not name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts and "\\" not in name
