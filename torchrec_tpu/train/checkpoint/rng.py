"""The process's random number generators (torch CPU, numpy, python ``random``) as one value.

On disk the state is plain tensors and numbers (no pickled objects), so it loads with
``torch.load(weights_only=True)``: a crafted RNG file cannot run code.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchrec_tpu.train.checkpoint.manifest import CheckpointError


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _to_tensors(state: dict[str, Any]) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    version, internal, gauss_next = state["python"]
    return {
        "torch": state["torch"],
        "numpy_name": name, "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": int(pos), "numpy_has_gauss": int(has_gauss),
        "numpy_cached_gaussian": float(cached_gaussian),
        "python_version": int(version), "python_internal": torch.tensor(internal, dtype=torch.int64),
        "python_gauss_next": gauss_next,
    }


def _from_tensors(saved: dict[str, Any]) -> dict[str, Any]:
    keys = saved["numpy_keys"].numpy().astype(np.uint32)
    return {
        "torch": saved["torch"],
        "numpy": (saved["numpy_name"], keys, saved["numpy_pos"], saved["numpy_has_gauss"],
                  saved["numpy_cached_gaussian"]),
        "python": (saved["python_version"], tuple(saved["python_internal"].tolist()),
                   saved["python_gauss_next"]),
    }


def save_rng(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_to_tensors(rng_state()), path)


def load_rng(path: Path) -> None:
    """Restore the generators saved by :func:`save_rng`; CheckpointError naming ``path`` when it
    is missing, holds anything but plain data, or is not such a state."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint has no RNG state for this rank")
    try:
        set_rng_state(_from_tensors(torch.load(path, weights_only=True)))
    except Exception as error:  # unpickling refused, a wrong structure, or a bad generator state
        first_line = (str(error).splitlines() or [""])[0]
        raise CheckpointError(f"{path} is not an RNG state saved by torchrec-tpu "
                              f"({type(error).__name__}: {first_line})") from None
