"""The process's random number generators (torch CPU, numpy, python ``random``) as one value."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_rng(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path)


def load_rng(path: Path) -> None:
    """Restore the generators saved by :func:`save_rng` (our own file: it holds numpy objects)."""
    set_rng_state(torch.load(path, weights_only=False))
