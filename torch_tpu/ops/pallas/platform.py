"""Where Pallas kernels run: Mosaic on a TPU backend, Pallas interpret mode everywhere else.

Interpret mode runs the same kernel body (TPU memory spaces and DMAs included) as ordinary XLA
operations, so the CPU path computes what the TPU path computes. :func:`lowering_for_tpu` forces the
Mosaic path while tracing, to lower a program for the TPU platform on a machine without one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from jax.experimental import pallas as pl

from torch_tpu.runtime._jax import jax
from tpu_facts.switches import Switch

_FORCE_MOSAIC = Switch("torch_tpu_pallas_force_mosaic")


def interpret() -> bool:
    """True when kernels traced now run in Pallas interpret mode (no TPU backend, not forced)."""
    return not (_FORCE_MOSAIC.is_on() or jax.default_backend() == "tpu")


def lowering_for_tpu() -> AbstractContextManager[None]:
    """Trace kernels for Mosaic (the TPU compiler) inside this block, e.g. for
    ``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))`` on a CPU-only machine."""
    return _FORCE_MOSAIC.on()


def batch_block(batch: int, preferred: int = 8) -> int:
    """Rows of the batch each kernel program handles: ``preferred`` when it divides the batch
    (TPU tiles are 8 rows), else the whole batch as one block."""
    return preferred if batch % preferred == 0 else batch


def kernel_call(kernel: Callable[..., None], **pallas_call_args: Any) -> Callable[..., Any]:
    """``pl.pallas_call(kernel, ...)`` for this platform (Mosaic or interpret mode), traced with 64-bit
    types off: Mosaic has none, and with ``jax_enable_x64`` on (as the tpu device runs) grid index
    maps would produce int64 block indices. Pass int32 / 32-bit float operands."""
    call = pl.pallas_call(kernel, interpret=interpret(), **pallas_call_args)

    def run(*operands: Any) -> Any:
        with jax.enable_x64(False):
            return call(*operands)

    return run


KERNEL_FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def check_float_operands(op: str, **tensors: torch.Tensor) -> None:
    """Refuse float operands the kernels do not take (Mosaic has no 64-bit types), naming them."""
    for name, t in tensors.items():
        if t.dtype not in KERNEL_FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} is {t.dtype}; the kernel takes {[str(d) for d in KERNEL_FLOAT_DTYPES]}")


def traceable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Let Dynamo trace into a kernel's Python entry point (torch_tpu/ is a Dynamo skip directory, so
    calling it would otherwise break the graph before the custom op)."""
    return torch._dynamo.dont_skip_tracing(fn)

