"""Where the checkpoints of ``torchrec-tpu train --model hstu`` (:mod:`torchrec_tpu.hstu.train`)
are, found without importing the model; which checkpoints ``infer`` does not serve (``--model dlrmv4``'s).

An HSTU checkpoint is a checkpoint of :mod:`~torchrec_tpu.train.checkpoint.store` (DCP state, so any
world size reads it; versioned directories under a root with ``latest``) whose ``meta.json`` records
the model (``HSTUConfig.to_dict``) under :data:`HSTU_META`. Checkpoints written before that are
*legacy*: ``<root>/step-N/`` holds, per rank R, ``dense-rank-R.pt`` (the STU stack and heads, Adam,
the data position) and ``tables-rank-R.pt`` (R's table shards and optimizer slots, pickled), then
``meta.json``; only the one-rank ones load anywhere but in the process group that wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchrec_tpu.train.checkpoint.dirs import is_checkpoint, resolve_checkpoint
from torchrec_tpu.train.model_kinds import ModelKind, model_kind

HSTU_META = "hstu"  # meta.json's record of the model (HSTUConfig.to_dict): what marks an HSTU checkpoint
META_FILE = "meta.json"
DLRMV4_META = "dlrmv4"  # meta.json's record of --model dlrmv4's architecture (DLRMv4Config's fields)
NOT_SERVED = ("a --model dlrmv4 checkpoint: infer is not built for it (its input is MLPerf's Yambda anchors, 11 "
              "features a sample, and no file of them exists here: the model trains on a synthetic stream)")


def dense_file(rank: int) -> str:
    """A legacy checkpoint's dense state of ``rank``."""
    return f"dense-rank-{rank:03d}.pt"


def tables_file(rank: int) -> str:
    """A legacy checkpoint's table shards of ``rank``."""
    return f"tables-rank-{rank:03d}.pt"


def is_legacy(directory: Path) -> bool:
    """Whether ``directory`` is a legacy HSTU checkpoint (per-rank pickled files, module docstring)."""
    return (Path(directory) / dense_file(0)).is_file()


def _latest_legacy(root: Path) -> Path | None:
    """The newest legacy ``step-N/`` of ``root`` whose ``meta.json`` was written (its last file)."""
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
    """The HSTU checkpoint ``path`` names: itself, or a root's ``latest`` (a legacy root: its newest
    ``step-N``); None when it names none (a DLRM checkpoint, say)."""
    path = Path(path)
    if is_checkpoint(path) or (path / META_FILE).is_file():
        directory: Path | None = path
    elif not path.is_dir():
        directory = None
    else:
        try:
            directory = resolve_checkpoint(path)
        except FileNotFoundError:
            directory = _latest_legacy(path)
    return directory if directory is not None and hstu_meta(directory) is not None else None


def legacy_state(directory: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, Adam's state dict) of ``rank`` in the legacy checkpoint ``directory``. Its
    files are pickles of arbitrary objects: load only checkpoints you trust."""
    import torch

    dense = torch.load(Path(directory) / dense_file(rank), weights_only=False, map_location="cpu")
    tables = torch.load(Path(directory) / tables_file(rank), weights_only=False, map_location="cpu")
    return {**dense["model"], **tables}, dense["adam"]


def model_kind_of(directory: Path) -> ModelKind:
    """The registry's entry of the model the HSTU checkpoint ``directory`` trained (its config's
    ``--model``; checkpoints that saved no config: ``hstu``)."""
    config = (hstu_meta(directory) or {}).get("config", {})
    kind = model_kind(config.get("model", "hstu"), config.get("task", "ranking"))
    assert kind is not None, f"{directory}: a checkpoint of --model {config.get('model')} --task {config.get('task')}"
    return kind


def refuse_unserved(path: Path) -> None:
    """ValueError naming why when ``path`` (a checkpoint, or a root: its latest) is one ``infer``
    does not serve (:data:`NOT_SERVED`)."""
    try:
        meta = json.loads((resolve_checkpoint(Path(path)) / META_FILE).read_text())
    except (OSError, ValueError):
        return
    if isinstance(meta, dict) and isinstance(meta.get(DLRMV4_META), dict):
        raise ValueError(f"--checkpoint {path}: {NOT_SERVED}")
