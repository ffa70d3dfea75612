"""The fused SparseCore updates applied in place to tpu tensors.

``torch.ops.tpu.sparse_dense_matmul_grad_with_<optimizer>`` is functional: called eagerly it
returns a whole new table (and slots) beside the old ones, each the table's size, although the
update only touches the batch's rows. :func:`fused_update_` runs the same op (its registered
lowering, the same program eager dispatch would compile) with the table's and slots' buffers
donated, and stores the results into those tensors: XLA writes the touched rows where they are,
and no second table ever exists. A buffer that another tensor shares (a ``clone`` of a tpu tensor
shares its JAX array) is copied first, so that tensor keeps its value.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from torch_tpu.ops import sparsecore as ops
from torch_tpu.ops.registry import get_lowering
from torch_tpu.runtime import device as tpu_device
from torch_tpu.runtime._jax import jax, jnp
from torch_tpu.runtime.tensor import TpuTensor, cpu_to_jax, to_jax, write


def fused_update_(name: str, *args: Any, **kwargs: Any) -> None:
    """``tpu::<name>(*args, **kwargs)`` (a fused ``sparse_dense_matmul_grad_with_*`` op) with its
    results stored into its ``embedding_table`` and slots, which must be tpu tensors; their
    buffers are donated to the program (see the module docstring). Inputs are checked as an eager
    call checks them."""
    if not name.startswith(ops.FUSED):
        raise ValueError(f"fused_update_ takes a fused op ({ops.FUSED}<optimizer>), got {name!r}")
    bound = ops.bind_args(name, args, kwargs)
    written = ("embedding_table", *ops.fused_arguments(name)[0])
    for key in written:
        if type(bound[key]) is not TpuTensor:
            raise TypeError(f"{name}: fused_update_ updates tpu tensors in place; {key} is on "
                            f"{getattr(bound[key], 'device', type(bound[key]).__name__)}")
    arrays = {k: to_jax(bound[k]) for k in written}
    arrays.update({k: to_jax(v) if type(v) is TpuTensor else cpu_to_jax(v)
                   for k, v in bound.items() if isinstance(v, torch.Tensor) and k not in written})
    static = tuple(sorted((k, v) for k, v in bound.items() if not isinstance(v, torch.Tensor)))
    ops.check_inputs(name, {**bound, **arrays}, np.asarray)
    for key in written:  # shared with another tensor (or an event): that one keeps the old buffer
        if _holders(arrays, key) > 2:
            arrays[key] = jnp.array(arrays[key], copy=True)
    names = tuple(arrays)  # the written ones first, in the op's order: XLA pairs donated inputs with outputs
    out = _program(name, static, names, len(written))(*arrays.values())
    out = out if isinstance(out, tuple) else (out,)
    for key, value in zip(written, out):
        write(bound[key], value)
    tpu_device.note_output(out[-1])  # (what torch.tpu.synchronize() waits for)


def _holders(arrays: dict[str, jax.Array], key: str) -> int:
    """References to ``arrays[key]`` besides the runtime's note of the last output and this
    call's own: the tensor's storage box and ``arrays`` when nothing else shares it."""
    return sys.getrefcount(arrays[key]) - 1 - (arrays[key] is tpu_device.last_output[0])


@lru_cache(maxsize=64)
def _program(name: str, static: tuple[tuple[str, Any], ...], names: tuple[str, ...],
             donated: int) -> Callable[..., Any]:
    """Op ``name``'s lowering of the arrays ``names`` (positional) and the non-tensor arguments
    ``static``, jitted with the first ``donated`` arrays donated."""
    lowering = get_lowering(ops.overload(name)).fn
    settings = dict(static)

    def run(*arrays: jax.Array) -> Any:
        return lowering(**dict(zip(names, arrays)), **settings)

    return jax.jit(run, donate_argnums=tuple(range(donated)))
