"""The whole state of a checkpoint written by ``torchrec-tpu train --model hstu``, read with stock
``torch.distributed.checkpoint`` (not the project's reader): every table unsharded, whatever world
size wrote it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def saved_state(root: Path, scratch: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state ``{"model": ..., "optimizer": ...}``, meta.json) of ``root``'s latest checkpoint."""
    directory = (root / "latest").resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / f"{directory.name}.pt"
    dcp_to_torch_save(directory / "state", out)
    return torch.load(out, weights_only=False), json.loads((directory / "meta.json").read_text())
