"""The ``tpu::sparse_dense_matmul*`` ops on a table sharded over devices: their DTensor rules.

When ``embedding_table`` (and every optimizer slot) is a ``DTensor`` placed ``Shard(0)`` on a 1-D
DeviceMesh of D devices, each rank passes its own device's CSR buffers (plain tensors, built for
``global_device_count=D``) and its own ``device_batch_size``; the table's ``Shard(0)`` block on
device d is exactly the physical rows of SparseCores d*S .. (d+1)*S-1 of the mod-sharded stacked
table. A real TPU exchanges ids and rows over ICI inside the SparseCore custom call; here the
exchange is explicit collectives on the mesh's process group (``tpu_dist`` on tpu tensors):

* ``sparse_dense_matmul``: all_gather the four CSR buffers (all devices' ids, device-major), sum
  each global sample's entries that hit local rows (the op with ``devices=D``, partial
  activations of the global batch [D*B, dim]) and reduce_scatter them: each rank gets its own
  samples' activations [B, dim], a plain tensor. Differentiable in the table: the gradient is a
  ``DTensor`` ``Shard(0)`` (``sparse_dense_matmul_grad`` below);
* ``sparse_dense_matmul_grad`` and ``_grad_with_<optimizer>``: all_gather the CSR buffers and the
  activation gradients [D*B, dim], then compute the gradient of (and update) the local rows only,
  with the local slots: no reduction, each row lives on one device. The fused ops return DTensors
  with the table's (and slots') placement.

The exchange is exact: every product gain * row is formed once, on the row's device; only the
order of the final sum of an activation row changes (per device, then across devices). The local
step is the jnp formulation on every platform (with D > 1): on a TPU, handing the local buffers to
the SparseCore custom call, which exchanges over ICI itself, would replace the collectives.

The rules are registered with ``torch.library.register_torch_dispatch(op, DTensor, rule)``, the
public hook for a tensor subclass's handling of a custom op: DTensor consults it before its own
sharding propagation, the op's schema stays TorchTPU's, and plain and DTensor arguments may mix.
(``register_sharding`` cannot express it: the CSR buffers are per-rank data, not a placement of a
global tensor the op reads, and the exchange is a custom one.) Registration waits for
``torch.distributed.tensor`` to be imported (it costs seconds), see :func:`register`.

Under ``torch.compile`` Dynamo graph-breaks at the op when its table is a DTensor (the op runs
eagerly between graphs, collectives included): the tpu backend does not lower collectives yet.
Traced elsewhere (``make_fx``, AOTAutograd by hand), the rules use functional collectives.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from torch_tpu.ops import sparsecore as ops
from torch_tpu.runtime.after_import import call_after_import

_CSR_ARGS = ("row_pointers", "embedding_ids", "sample_ids", "gains")


def register(lib: torch.library.Library) -> None:
    """Register the DTensor rules of every ``tpu::sparse_dense_matmul*`` op in ``lib``, now if
    ``torch.distributed.tensor`` is imported, else as soon as it is."""
    if dist.is_available():
        call_after_import("torch.distributed.tensor", "DTensor", lambda: _register(lib))


def _register(lib: torch.library.Library) -> None:
    from torch.distributed.tensor import DTensor

    for name in ops.SCHEMAS:
        torch.library.register_torch_dispatch(f"{ops.NAMESPACE}::{name}", DTensor, _rule(name), lib=lib)


def _rule(name: str):
    def rule(cls: type, func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
        return _sharded_call(name, ops.bind_args(name, args, kwargs or {}))

    rule.__name__ = f"{name}_on_dtensor"
    return rule


def _sharded_call(name: str, a: dict[str, Any]) -> Any:
    from torch.distributed.tensor import DTensor

    table = a["embedding_table"]
    if not isinstance(table, DTensor):
        bad = [k for k, v in a.items() if isinstance(v, DTensor)]
        raise TypeError(f"tpu::{name}: {bad} are DTensors but embedding_table is not; only the table and its "
                        "optimizer slots may be DTensors (sharded Shard(0) on a 1-D mesh)")
    mesh = table.device_mesh
    slots = ops.fused_arguments(name)[0]
    for key in ("embedding_table", *slots):
        _check_row_sharded(name, key, a[key], mesh)
    _graph_break_under_dynamo(name)
    devices, device_index = mesh.size(), mesh.get_local_rank()
    from sparsecore import csr_math

    for key in _CSR_ARGS:
        if isinstance(a[key], DTensor):
            raise TypeError(f"tpu::{name}: {key} must be this device's own buffer (a plain tensor), got a DTensor")
    if a.get("num_minibatches", 1) != 1:
        raise ValueError(f"tpu::{name}: num_minibatches {a['num_minibatches']} is not supported with DTensor tables "
                         "(minibatched buffers are one device's)")
    csr_math.sparsecores_per_device(a["row_pointers"].shape[0], devices)  # the layout of D devices
    for key in ("grad_rows", "output_rows"):
        if a.get(key) is not None:
            raise ValueError(f"tpu::{name}: {key} is not supported with DTensor tables (activations and their "
                             "gradient in activation row order)")
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in a.items()}
    local.update({k: _all_gather(a[k], mesh) for k in _CSR_ARGS})
    if "activations_grad" in a:
        local["activations_grad"] = _all_gather(local["activations_grad"].contiguous(), mesh)
    local["device_batch_size"] = devices * a["device_batch_size"]
    if "touched_rows" in local:  # computed for this device's buffers, not the gathered ones
        local["touched_rows"] = None
    local.update(devices=devices, device_index=device_index)
    out = getattr(torch.ops.tpu, name)(**local)
    if name == "sparse_dense_matmul":
        return _reduce_scatter(out, mesh)
    if name == "sparse_dense_matmul_grad":
        return _like(out, table)
    outs = out if isinstance(out, tuple) else (out,)
    wrapped = tuple(_like(o, a[k]) for o, k in zip(outs, ("embedding_table", *slots)))
    return wrapped if len(wrapped) > 1 else wrapped[0]


def _check_row_sharded(name: str, key: str, value: Any, mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        raise TypeError(f"tpu::{name}: {key} must be a DTensor like embedding_table, got {type(value).__name__}")
    if value.device_mesh != mesh or mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
        raise ValueError(f"tpu::{name}: {key} is placed {tuple(value.placements)} on a {mesh.ndim}-D mesh; "
                         "needs (Shard(0),) on the table's 1-D mesh")
    if value.shape[0] % mesh.size():
        raise ValueError(f"tpu::{name}: {key} has {value.shape[0]} rows, not a multiple of the {mesh.size()} "
                         "devices (even Shard(0) blocks of SparseCore shards)")


def _like(local: torch.Tensor, reference: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, reference.device_mesh, reference.placements, run_check=False,
                              shape=reference.shape, stride=reference.stride())


def _graph_break_under_dynamo(name: str) -> None:
    """Dynamo runs the op on fake DTensors to trace it: make that a graph break (see module docstring)."""
    convert = sys.modules.get("torch._dynamo.symbolic_convert")  # Dynamo is not imported: not tracing
    if convert is None or getattr(convert.tls, "current_tx", None) is None:
        return
    from torch._dynamo.exc import unimplemented

    unimplemented(gb_type="SparseCore op on a sharded table",
                  context=f"tpu::{name} with a DTensor embedding_table",
                  explanation="its cross-device exchange runs as eager collectives; the tpu backend lowers none yet",
                  hints=[])


def _traced(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor)) or torch.compiler.is_compiling()


def _all_gather(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """[D * n, ...]: every device's ``t`` [n, ...], device-major."""
    if _traced(t):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_gather_tensor(t, 0, mesh)
    out = t.new_empty((mesh.size() * t.shape[0], *t.shape[1:]))
    dist.all_gather_single(out, t.contiguous(), group=mesh.get_group())
    return out


def _reduce_scatter(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This device's block [n, ...] of the sum over devices of ``t`` [D * n, ...]."""
    if _traced(t):
        from torch.distributed import _functional_collectives as funcol

        return funcol.reduce_scatter_tensor(t, "sum", 0, mesh)
    out = t.new_empty((t.shape[0] // mesh.size(), *t.shape[1:]))
    dist.reduce_scatter_single(out, t.contiguous(), group=mesh.get_group())
    return out
