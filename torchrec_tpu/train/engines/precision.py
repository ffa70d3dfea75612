"""``--precision``: the dense towers' matmuls in float32 or in bfloat16 (as TPUs train), with
float32 parameters, optimizer state and accumulation either way.

bf16 runs the towers' forward under ``torch.autocast`` with bfloat16 on the towers' device (the
tpu device's policy: matmuls, linear layers and DLRM's interaction cast to bf16, the loss and
reductions kept in fp32; CPU torch's for towers on the host, TorchRec's engine included);
backward follows the forward's dtypes, as autocast's own. Evaluation computes as training does.
"""

from __future__ import annotations

import contextlib
import functools
from typing import ContextManager

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from torchrec_tpu.train.config import PRECISIONS
from torchrec_tpu.train.loop import StepFn, train_step
from torchrec_tpu.train.metrics import EvalForward, model_outputs


def autocast(device_type: str, precision: str) -> ContextManager:
    """The forward's precision context for towers on ``device_type`` ("cpu" or "tpu")."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def eager_train_step(device_type: str, precision: str) -> StepFn:
    """:func:`~torchrec_tpu.train.loop.train_step` with the forward at ``precision`` for towers
    on ``device_type`` (backward outside autocast, as torch advises)."""
    if precision == "fp32":
        return train_step
    return functools.partial(train_step, forward_context=lambda: autocast(device_type, precision))


def eager_eval_forward(device_type: str, precision: str) -> EvalForward:
    """:func:`~torchrec_tpu.train.metrics.model_outputs` with the towers on ``device_type`` at
    ``precision``, the logits float32."""
    if precision == "fp32":
        return model_outputs

    def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
        with autocast(device_type, precision):
            logits = model_outputs(model, batch)
        return logits.float()

    return forward
