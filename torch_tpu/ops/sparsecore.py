"""SparseCore as torch ops on the tpu device, under TorchTPU's names (namespace ``tpu``).

* ``tpu::sparse_dense_matmul``: the pooled lookup of one device's CSR-wrapped COO buffers
  (``sparsecore.csr_format``) against its mod-sharded table, ``[device_batch_size, dim]``;
  differentiable in ``embedding_table`` (the dense table gradient, ``tpu::sparse_dense_matmul_grad``);
* ``tpu::sparse_dense_matmul_grad_with_{sgd,adagrad,adam}``: the fused backward + optimizer
  update a fused-optimizer module calls in backward, returning the new table (and slots);
  beyond TorchTPU's three: ``_with_rowwise_adagrad`` and ``_with_ftrl`` (lazy Adam is ``_with_adam``:
  only touched rows move).

Each op has a fake kernel, a CPU kernel (torch, the reference) and a tpu lowering in the op
registry, so it runs eagerly on tpu tensors and inside ``torch.compile(backend="tpu")`` graphs.
The lowering is ``sparsecore.csr_math`` (jnp) off TPU and jax-tpu-embedding's SparseCore
primitives (``sparsecore.csr_kernels``) on TPU; both are imported inside the lowering, so
``import torch_tpu`` loads neither. :func:`register` (from ``torch_tpu.ops.register``) defines them.

S, the SparseCores of the device, is read from the row-pointer buffer's size (S regions of
max(S, 8) pointers, as ``sparsecore.preprocess`` builds them for one device).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax

NAMESPACE = "tpu"
_CSR = "Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains, Tensor embedding_table"
_LIMITS = "int device_batch_size, int max_ids_per_partition, int max_unique_ids_per_partition"
_NAME = 'str computation_name=""'
SCHEMAS = {
    "sparse_dense_matmul": f"({_CSR}, {_LIMITS}) -> Tensor",
    "sparse_dense_matmul_grad": f"({_CSR}, Tensor activations_grad, {_LIMITS}) -> Tensor",
    "sparse_dense_matmul_grad_with_sgd":
        f"({_CSR}, Tensor activations_grad, Tensor learning_rate, {_LIMITS}, {_NAME}) -> Tensor",
    "sparse_dense_matmul_grad_with_adagrad":
        f"({_CSR}, Tensor accumulator, Tensor activations_grad, Tensor learning_rate, Tensor epsilon, {_LIMITS}, "
        f"{_NAME}) -> (Tensor, Tensor)",
    "sparse_dense_matmul_grad_with_adam":
        f"({_CSR}, Tensor momentum, Tensor velocity, Tensor activations_grad, Tensor alpha_t, float beta_1, "
        f"float beta_2, float epsilon, {_LIMITS}, {_NAME}) -> (Tensor, Tensor, Tensor)",
    "sparse_dense_matmul_grad_with_rowwise_adagrad":
        f"({_CSR}, Tensor accumulator, Tensor activations_grad, Tensor learning_rate, Tensor epsilon, {_LIMITS}, "
        f"{_NAME}) -> (Tensor, Tensor)",
    "sparse_dense_matmul_grad_with_ftrl":
        f"({_CSR}, Tensor accumulator, Tensor linear, Tensor activations_grad, Tensor learning_rate, "
        f"float learning_rate_power, float l1_regularization_strength, float l2_regularization_strength, "
        f"float beta, {_LIMITS}, {_NAME}) -> (Tensor, Tensor, Tensor)",
}
# the slot tensors each fused op takes after the table (and returns after it)
SLOTS = {"sgd": (), "adagrad": ("accumulator",), "adam": ("momentum", "velocity"),
         "rowwise_adagrad": ("accumulator",), "ftrl": ("accumulator", "linear")}
_libs: list[torch.library.Library] = []


def _overload(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.tpu, name).default


# --- the math on the tpu device: jnp off TPU, SparseCore primitives on TPU -----------------------


def _on_tpu_platform() -> bool:
    return jax.default_backend() == "tpu"


def _lookup(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size,
            max_ids_per_partition, max_unique_ids_per_partition):
    if _on_tpu_platform():
        from sparsecore import csr_kernels

        return csr_kernels.sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, embedding_table,
                                               device_batch_size, max_ids_per_partition,
                                               max_unique_ids_per_partition)
    from sparsecore import csr_math

    return csr_math.sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, embedding_table,
                                        device_batch_size)


def _lookup_grad(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                 device_batch_size, max_ids_per_partition, max_unique_ids_per_partition):
    from sparsecore import csr_math

    grad, _ = csr_math.table_grad(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad)
    return grad.astype(embedding_table.dtype)


def _bind(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name (defaults filled in)."""
    schema = _overload(name)._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update(zip((a.name for a in schema.arguments), args))
    bound.update(kwargs)
    return bound


def _fused(optimizer: str):
    """The lowering of ``sparse_dense_matmul_grad_with_<optimizer>``."""
    name = f"sparse_dense_matmul_grad_with_{optimizer}"
    slots = SLOTS[optimizer]

    def lowering(*args, **kwargs):
        a = _bind(name, args, kwargs)
        csr = tuple(a[k] for k in ("row_pointers", "embedding_ids", "sample_ids", "gains"))
        names = [x.name for x in _overload(name)._schema.arguments]
        first = names.index("activations_grad") + 1
        hypers = [a[k] for k in names[first:first + _HYPERS[optimizer]]]
        table, table_slots, grad = a["embedding_table"], [a[k] for k in slots], a["activations_grad"]
        if _on_tpu_platform():
            from sparsecore import csr_kernels

            limits = (a["device_batch_size"], a["max_ids_per_partition"], a["max_unique_ids_per_partition"])
            return csr_kernels.fused_update(optimizer, csr, table, table_slots, grad, hypers, *limits,
                                            a["computation_name"] or f"{optimizer}_optimizer_update")
        from sparsecore import csr_math

        g, touched = csr_math.table_grad(*csr, table, grad)
        return getattr(csr_math, optimizer)(table, *table_slots, g, touched, *hypers)

    return lowering


_HYPERS = {"sgd": 1, "adagrad": 2, "adam": 4, "rowwise_adagrad": 2, "ftrl": 5}


# --- the CPU kernels: the same math in torch ------------------------------------------------------


def _decode_cpu(row_pointers, embedding_ids, sample_ids, gains, table_rows: int, batch_size: int):
    """(physical row, activation row, gain) of every real entry, in buffer order (numpy)."""
    from sparsecore.csr_math import sparsecores_per_device

    rp = row_pointers.cpu().numpy().astype(np.int64)
    s = sparsecores_per_device(rp.size)
    region = embedding_ids.numel() // s
    ends = rp.reshape(s, -1)[:, :s]
    phys, rows, keep = [], [], []
    ids, samples = embedding_ids.cpu().numpy().astype(np.int64), sample_ids.cpu().numpy().astype(np.int64)
    for k in range(s):
        end = 0
        for p in range(s):
            start, end = -(-end // 8) * 8, int(ends[k, p])
            at = np.arange(k * region + start, k * region + end)
            keep.append(at)
            phys.append(p * (table_rows // s) + ids[at])
            rows.append(k * (batch_size // s) + samples[at])
    at = torch.from_numpy(np.concatenate(keep))
    return torch.from_numpy(np.concatenate(phys)), torch.from_numpy(np.concatenate(rows)), gains.cpu()[at]


def _lookup_cpu(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size,
                max_ids_per_partition, max_unique_ids_per_partition):
    phys, rows, gain = _decode_cpu(row_pointers, embedding_ids, sample_ids, gains, embedding_table.shape[0],
                                   device_batch_size)
    out = torch.zeros(device_batch_size, embedding_table.shape[1], dtype=embedding_table.dtype)
    return out.index_add_(0, rows, gain[:, None] * embedding_table[phys])


def _table_grad_cpu(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad):
    phys, rows, gain = _decode_cpu(row_pointers, embedding_ids, sample_ids, gains, embedding_table.shape[0],
                                   activations_grad.shape[0])
    grad = torch.zeros_like(embedding_table, dtype=torch.float32)
    grad.index_add_(0, phys, gain[:, None] * activations_grad.float()[rows])
    touched = torch.zeros(embedding_table.shape[0], dtype=torch.bool)
    touched[phys] = True
    return grad, touched


def _lookup_grad_cpu(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                     device_batch_size, max_ids_per_partition, max_unique_ids_per_partition):
    grad, _ = _table_grad_cpu(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad)
    return grad.to(embedding_table.dtype)


def _keep(touched: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(touched.reshape((-1,) + (1,) * (old.dim() - 1)), new, old).to(old.dtype)


def _update_cpu(optimizer: str, table, slots, g, touched, hypers) -> tuple[torch.Tensor, ...]:
    f32 = torch.float32
    if optimizer == "sgd":
        (lr,) = hypers
        return (_keep(touched, table - lr.to(f32) * g, table),)
    if optimizer in ("adagrad", "rowwise_adagrad"):
        (acc_old,), (lr, eps) = slots, hypers
        if optimizer == "adagrad":
            acc = acc_old + g * g
            denom = acc.sqrt() + eps.to(f32)
        else:
            acc = acc_old + (g * g).sum(dim=1) / g.shape[1]
            denom = acc.sqrt()[:, None] + eps.to(f32)
        return _keep(touched, table - lr.to(f32) * g / denom, table), _keep(touched, acc, acc_old)
    if optimizer == "adam":
        (m_old, v_old), (alpha, b1, b2, eps) = slots, hypers
        c1, c2, eps = (torch.tensor(x, dtype=f32) for x in (1.0 - b1, 1.0 - b2, eps))  # 1 - b in double
        m = m_old + c1 * (g - m_old)
        if v_old.dim() == 1:
            v = ((v_old[:, None] + c2 * (g * g - v_old[:, None])) / g.shape[1]).sum(dim=1)
            denom = v.sqrt()[:, None] + eps
        else:
            v = v_old + c2 * (g * g - v_old)
            denom = v.sqrt() + eps
        new = table - alpha.to(f32) * m / denom
        return _keep(touched, new, table), _keep(touched, m, m_old), _keep(touched, v, v_old)
    (acc_old, lin_old), (lr, power, l1, l2, beta) = slots, hypers
    lr = lr.to(f32)
    k = torch.tensor(-power, dtype=f32)
    acc = acc_old + g * g
    p_new = acc**k
    lin = lin_old + g - (p_new - acc_old**k) / lr * table
    l1, l2, beta = (torch.tensor(x, dtype=f32) for x in (l1, l2, beta))
    new = (torch.clamp(lin, -l1, l1) - lin) / ((p_new + beta) / lr + 2.0 * l2)
    return _keep(touched, new, table), _keep(touched, acc, acc_old), _keep(touched, lin, lin_old)


def _fused_cpu(optimizer: str):
    name = f"sparse_dense_matmul_grad_with_{optimizer}"
    slots = SLOTS[optimizer]

    def kernel(*args, **kwargs):
        a = _bind(name, args, kwargs)
        names = [x.name for x in _overload(name)._schema.arguments]
        first = names.index("activations_grad") + 1
        hypers = [a[k] for k in names[first:first + _HYPERS[optimizer]]]
        csr = tuple(a[k] for k in ("row_pointers", "embedding_ids", "sample_ids", "gains"))
        g, touched = _table_grad_cpu(*csr, a["embedding_table"], a["activations_grad"])
        out = _update_cpu(optimizer, a["embedding_table"], [a[k] for k in slots], g, touched, hypers)
        return out if len(out) > 1 else out[0]

    return kernel


# --- fake kernels and autograd -----------------------------------------------------------------------


def _lookup_fake(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size, *_: Any):
    return embedding_table.new_empty((device_batch_size, embedding_table.shape[1]), dtype=torch.float32)


def _lookup_grad_fake(row_pointers, embedding_ids, sample_ids, gains, embedding_table, *_: Any):
    return torch.empty_like(embedding_table)


def _fused_fake(optimizer: str):
    slots = SLOTS[optimizer]

    def fake(*args, **kwargs):
        a = _bind(f"sparse_dense_matmul_grad_with_{optimizer}", args, kwargs)
        out = (torch.empty_like(a["embedding_table"]), *(torch.empty_like(a[s]) for s in slots))
        return out if len(out) > 1 else out[0]

    return fake


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.limits = inputs[5:8]


def _lookup_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    row_pointers, embedding_ids, sample_ids, gains, embedding_table = ctx.saved_tensors
    table_grad = torch.ops.tpu.sparse_dense_matmul_grad(row_pointers, embedding_ids, sample_ids, gains,
                                                        embedding_table, grad.contiguous(), *ctx.limits)
    return None, None, None, None, table_grad, None, None, None


def register() -> None:
    """Define the ``tpu::`` SparseCore ops with their CPU, fake and tpu kernels (once)."""
    if _libs:
        return
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    _libs.append(lib)
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
    lib.impl("sparse_dense_matmul", _lookup_cpu, "CPU")
    lib.impl("sparse_dense_matmul_grad", _lookup_grad_cpu, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::sparse_dense_matmul", _lookup_fake, lib=lib)
    torch.library.register_fake(f"{NAMESPACE}::sparse_dense_matmul_grad", _lookup_grad_fake, lib=lib)
    register_lowering(_overload("sparse_dense_matmul"))(_lookup)
    register_lowering(_overload("sparse_dense_matmul_grad"))(_lookup_grad)
    torch.library.register_autograd(f"{NAMESPACE}::sparse_dense_matmul", _lookup_backward,
                                    setup_context=_setup_context, lib=lib)
    for optimizer in SLOTS:
        name = f"sparse_dense_matmul_grad_with_{optimizer}"
        lib.impl(name, _fused_cpu(optimizer), "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _fused_fake(optimizer), lib=lib)
        register_lowering(_overload(name))(_fused(optimizer))
