"""``--precision``: the dense towers' matmuls in float32 or in bfloat16 (as TPUs train), with
float32 parameters, optimizer state and accumulation either way.

bf16 runs the towers' forward under ``torch.autocast`` with bfloat16 on the towers' device (the
tpu device's policy: matmuls, linear layers and DLRM's interaction cast to bf16, the loss and
reductions kept in fp32; CPU torch's for towers on the host, TorchRec's engine included);
backward follows the forward's dtypes, as autocast's own.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

PRECISIONS = ("fp32", "bf16")


def autocast(device_type: str, precision: str) -> ContextManager:
    """The forward's precision context for towers on ``device_type`` ("cpu" or "tpu")."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)
