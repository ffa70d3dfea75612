"""``torch.autocast("tpu")``: mixed precision on the device, bfloat16 by default.

torch registers autocast policies in C++ for its own devices only; for PrivateUse1 it registers
nothing, so every op under ``torch.autocast("tpu")`` failed ("Could not run ... 'Autocasttpu'
backend"). Here the policy torch applies to its accelerators (CUDA, XPU, MTIA: the lists of
``aten/src/ATen/autocast_mode.cpp``) is registered at the AutocastPrivateUse1 key:

- matmul-like ops (mm, linear, convolutions, attention, RNN cells, ...) cast floating tpu tensor
  arguments to the autocast dtype;
- numerically sensitive ops (exp, log, pow, softmax, norms, losses, sums, ...) cast them to float32;
- a few multi-input ops (addcmul, dot, index_put, scatter_add, ...) cast them to the widest
  floating type among them;
- binary_cross_entropy raises, as on CUDA (unsafe in reduced precision: use the ``_with_logits`` form);
- every other op runs as called (a fallthrough).

Tensors that are not floating, not on tpu, or float64 are never cast, as torch's own policy.
Kernels only run inside an autocast region (the key is excluded otherwise): no cost outside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_tpu.runtime.tensor import DEVICE_NAME

DEFAULT_DTYPE = torch.bfloat16

LOWER_PRECISION = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "rms_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "softmax", "log_softmax", "cumprod", "cumsum", "prod", "sum", "norm", "linalg_vector_norm", "linalg_matrix_norm",
)
WIDEST = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
          "tensordot", "scatter_add")
BANNED = ("binary_cross_entropy",)

_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_KEY_NAME = "AutocastPrivateUse1"
_LIBRARIES: list[torch.library.Library] = []  # registrations live as long as their Library


def _eligible(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
            and x.device.type == DEVICE_NAME)


def _cast_all(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    return pytree.tree_map(lambda x: x.to(dtype) if _eligible(x) and x.dtype != dtype else x, (args, kwargs))


def _lower_precision(args: tuple, kwargs: dict) -> torch.dtype:
    return torch.get_autocast_dtype(DEVICE_NAME)


def _float32(args: tuple, kwargs: dict) -> torch.dtype:
    return torch.float32


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    dtypes = [x.dtype for x in pytree.tree_leaves((args, kwargs)) if _eligible(x)]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else None  # bf16 with fp16: fp32


def _banned(args: tuple, kwargs: dict) -> None:
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (the sigmoid "
        "before them saturates in reduced precision); use binary_cross_entropy_with_logits / "
        "BCEWithLogitsLoss, which are safe to autocast, or run the loss outside the autocast region")


def _kernel(op: torch._ops.OpOverload, target: Callable[[tuple, dict], torch.dtype | None]) -> Callable[..., Any]:
    def autocast_kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = target(args, kwargs)
        if dtype is not None:
            args, kwargs = _cast_all(args, kwargs, dtype)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            return op(*args, **kwargs)

    return autocast_kernel


def _functional_overloads(name: str) -> list[torch._ops.OpOverload]:
    """Every overload of ``aten::name`` that writes no argument (out= and in-place forms are not
    autocast, as in torch)."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return []
    overloads = [getattr(packet, overload) for overload in packet.overloads()]
    return [op for op in overloads if not op._schema.is_mutable]


def register() -> None:
    """Register the policies and the fallthrough (idempotent); make bfloat16 this thread's default
    autocast dtype for tpu (torch keeps that default per thread)."""
    torch.set_autocast_dtype(DEVICE_NAME, DEFAULT_DTYPE)
    if _LIBRARIES:
        return
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, _KEY_NAME)
    kernels = torch.library.Library("aten", "IMPL")
    policies = ((LOWER_PRECISION, _lower_precision), (FLOAT32, _float32), (WIDEST, _widest), (BANNED, _banned))
    for names, target in policies:
        for name in names:
            for op in _functional_overloads(name):
                kernels.impl(op, _kernel(op, target), _KEY_NAME)
    _LIBRARIES.extend([fallthrough, kernels])
