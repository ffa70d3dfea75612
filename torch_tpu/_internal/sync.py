"""``torch_tpu._internal.sync``: TorchTPU's names for materializing and waiting on tpu tensors.

Code written for TorchTPU (TorchRec's TPU kernel tests and benchmarks) calls
``synchronize(tensor, wait=True)`` before reading a clock. Here a tensor is *materialized* once
its value is a computed (or in-flight) JAX array: always, except for ops deferred under the
``defer_and_fuse`` eager mode, which materializing runs (``torch_tpu.eager.lazy``).

* ``synchronize(*tensors, wait=True)``: materialize ``tensors`` (tensors or lists of them; none:
  everything dispatched so far) and, with ``wait``, wait until their values are computed;
* ``is_materialized(tensor)`` / ``is_materializing(tensor)``: its value is computed or in flight /
  in flight (the device still computing it);
* ``computation_mlir(*tensors)`` / ``computation_graphviz(*tensors)`` /
  ``dump_computation_graphviz(tensors, file_name)``: the computation still to run to produce
  ``tensors``, as StableHLO text / a Graphviz digraph. Materialized tensors are its inputs, so
  outside defer_and_fuse it is the identity over them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_tpu.eager.lazy import LazyArray
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.device import synchronize as _wait_for_device
from torch_tpu.runtime.tensor import TpuTensor, concrete_value

__all__ = ["computation_graphviz", "computation_mlir", "dump_computation_graphviz", "is_materialized",
           "is_materializing", "synchronize"]


def _tpu_tensors(tensors: Any) -> list[TpuTensor]:
    return [t for t in pytree.tree_leaves(tensors) if type(t) is TpuTensor]


def synchronize(*tensors: Any, wait: bool = True) -> None:
    """Materialize ``tensors`` (none: every op dispatched so far) and, with ``wait``, wait for them."""
    leaves = _tpu_tensors(tensors)
    if not leaves and not tensors:
        if wait:
            _wait_for_device()
        return
    arrays = [concrete_value(t) for t in leaves]
    if wait:
        jax.block_until_ready(arrays)


def _array(tensor: torch.Tensor) -> Any:
    if type(tensor) is not TpuTensor:
        raise TypeError(f"expected a tpu tensor, got a tensor on {tensor.device}")
    return tensor.storage_box.array


def is_materialized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s value is computed or being computed (not a deferred op)."""
    return type(_array(tensor)) is not LazyArray


def is_materializing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s value is being computed now (materialized, not ready yet)."""
    array = _array(tensor)
    return type(array) is not LazyArray and not (array.is_deleted() or array.is_ready())


def computation_mlir(*tensors: Any) -> str:
    """The StableHLO text of the computation producing ``tensors`` (module docstring)."""
    arrays = [concrete_value(t) for t in _tpu_tensors(tensors)]
    return jax.jit(lambda *xs: xs).lower(*arrays).as_text()


def computation_graphviz(*tensors: Any) -> str:
    """The computation producing ``tensors`` as a Graphviz digraph: one node per tensor."""
    lines = ["digraph computation {"]
    for i, t in enumerate(_tpu_tensors(tensors)):
        lines.append(f'  t{i} [label="{i}: {t.dtype} {list(t.shape)}"];')
    return "\n".join([*lines, "}"]) + "\n"


def dump_computation_graphviz(tensors: list[torch.Tensor], file_name: str) -> None:
    """Write :func:`computation_graphviz` of ``tensors`` to ``file_name`` (directories created)."""
    directory = os.path.dirname(file_name)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(file_name, "w") as f:
        f.write(computation_graphviz(*tensors))
