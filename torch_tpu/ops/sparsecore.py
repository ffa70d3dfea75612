"""SparseCore as torch ops on the tpu device, under TorchTPU's names (namespace ``tpu``).

* ``tpu::sparse_dense_matmul``: the pooled lookup of one device's CSR-wrapped COO buffers
  (``sparsecore.csr_format``) against its mod-sharded table, ``[device_batch_size, dim]``;
  differentiable in ``embedding_table`` (the dense table gradient, ``tpu::sparse_dense_matmul_grad``);
* ``tpu::sparse_dense_matmul_grad_with_{sgd,adagrad,adam}``: the fused backward + optimizer
  update a fused-optimizer module calls in backward, returning the new table (and slots);
  beyond TorchTPU's three: ``_with_rowwise_adagrad`` and ``_with_ftrl`` (lazy Adam is ``_with_adam``:
  only touched rows move).

Beyond TorchTPU's schemas every op takes ``num_minibatches`` (default 1): above 1 the buffers
hold that many minibatches of one device's batch in jax-tpu-embedding's minibatching layout
(``sparsecore.minibatching.op_buffers``: a batch over the partition limits split into passes that
fit), whose result is the one pass's; on a TPU the kernels get the count. Not with DTensors.
The lookup and the fused ops also take an optional ``touched_rows``: the
buffers' deduplication computed ahead (:func:`touched_rows_ahead`, e.g. on a prefetch thread while
the previous step runs). With it the XLA formulation neither sorts on the device nor reads a row
twice (same results, bit for bit); on a TPU it is ignored. It must be computed from the buffers
passed with it: eager calls check that (recomputing it on the host); inside compiled programs
other values give undefined results.
The fused ops also take an optional ``grad_rows`` [device_batch_size]: ``activations_grad`` is
then any [R, dim] matrix and activation row r's gradient its row ``grad_rows[r]`` (e.g. a layer's
output gradient whose rows interleave several stacks: the op gathers the rows it needs instead of
the caller permuting the whole gradient first; same results, bit for bit). Likewise the lookup
takes an optional ``output_rows``, a permutation of its activation rows: it returns activation
row r as row ``output_rows[r]``, and its gradient is read back alike. Neither with DTensors.

Inputs are checked (``torch_tpu.ops.sparsecore_checks``): a bad buffer raises one ValueError
naming the argument, the value and its limit. Eager calls (CPU and tpu, every eager mode) check
dtypes, shapes and the CSR values (row pointers in their region and non-decreasing, ids below the
rows of a partition, sample ids below ``device_batch_size / N``, no partition over
``max_ids_per_partition``, a ``touched_rows`` of the same buffers; padding positions are not read);
traces check dtypes and shapes. Inside compiled programs the ``debug`` mode checks the values of
graph inputs before the program runs; ``strict`` and ``defer_and_fuse`` leave out-of-range values
undefined, as a TPU does. The engine's own calls, on buffers its host preprocessing built, skip
the value checks through ``sparsecore_checks.preprocessed()``.

Each op has a fake kernel, a CPU kernel (torch, the reference) and a tpu lowering in the op
registry, so it runs eagerly on tpu tensors and inside ``torch.compile(backend="tpu")`` graphs.
The lowering is ``sparsecore.csr_math`` (jnp) off TPU and jax-tpu-embedding's SparseCore
primitives (``sparsecore.csr_kernels``) on TPU; both are imported inside the lowering, so
``import torch_tpu`` loads neither. :func:`register` (from ``torch_tpu.ops.register``) defines them.

With plain tensors the ops serve one device: S, its SparseCores, is read from the row-pointer
buffer's size (S regions of max(S, 8) pointers, as ``sparsecore.preprocess`` builds them for one
device) and the table holds all S shards.

Several devices (``torch_tpu.ops.sparsecore_dtensor``): when ``embedding_table`` (and every
optimizer slot) is a ``DTensor`` placed ``Shard(0)`` on a 1-D DeviceMesh of D ranks, each rank
passes its own device's buffers (built for D devices: N = D * S partitions) and its own
``device_batch_size``, and gets its own samples' activations (a plain tensor); the table gradient
and the fused ops' new table and slots are DTensors with the same placement. The collectives
run on the mesh's process group; the local step is the same op with ``devices`` = D and
``device_index`` = d (the op over the gathered buffers of all devices and device d's block of rows).

Each op is defined once, here (one schema); TorchTPU's spellings ``tpu::_sparse_dense_matmul*`` and
``torch.tpu.ops.*`` are aliases in ``torch_tpu._internal``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from torch_tpu.ops import sparsecore_checks as checks
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax
from tpu_facts.switches import Switch

NAMESPACE = "tpu"
_CSR = "Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains, Tensor embedding_table"
_LIMITS = "int device_batch_size, int max_ids_per_partition, int max_unique_ids_per_partition"
# beyond TorchTPU's schemas: csr_math.touched_rows of the buffers computed ahead (off TPU the lowerings
# then neither sort nor read a row twice; a SparseCore deduplicates in hardware and ignores it)
_AHEAD = "Tensor? touched_rows=None"
# every op also takes the sharding of its local step under the DTensor rules (torch_tpu.ops.sparsecore_dtensor):
# the buffers of all ``devices`` devices (gathered device-major) and the table block (and slots) of ``device_index``
_SHARDING = "int devices=1, int device_index=0"
# beyond them too, the lookup's output_rows: a permutation of its activation rows (the caller's layout);
# the fused ops' grad_rows: the row of activations_grad holding each activation row's gradient
# (activations_grad may then be a whole layer's output gradient, which the op reads no permuted copy of)
# and num_minibatches: the buffers hold that many minibatch slots (jax-tpu-embedding's minibatching
# layout, sparsecore.minibatching.op_buffers; one device's) instead of one pass
_PASSES = "int num_minibatches=1"
_NAME = f'str computation_name="", {_AHEAD}, Tensor? grad_rows=None, {_PASSES}, {_SHARDING}'
SCHEMAS = {
    "sparse_dense_matmul":
        f"({_CSR}, {_LIMITS}, {_AHEAD}, Tensor? output_rows=None, {_PASSES}, {_SHARDING}) -> Tensor",
    "sparse_dense_matmul_grad": f"({_CSR}, Tensor activations_grad, {_LIMITS}, {_PASSES}, {_SHARDING}) -> Tensor",
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
FUSED = "sparse_dense_matmul_grad_with_"
# the optimizers with a fused op (sparsecore.optimizer_rules holds the rest of each one's record)
OPTIMIZERS = tuple(name.removeprefix(FUSED) for name in SCHEMAS if name.startswith(FUSED))
_libs: list[torch.library.Library] = []
# the modules the lowerings compute in (the compile cache's key covers their source)
LOWERING_SOURCES = ("sparsecore.csr_math", "sparsecore.entries", "sparsecore.optimizer_rules", "sparsecore.csr_kernels",
                    "sparsecore.csr_format", "sparsecore.table_rows")


def kernel_export_checks() -> list:
    """What ``jax.export`` must admit for programs calling the ops' CPU kernel (the fused updates'
    row scatter, :mod:`sparsecore.table_rows`)."""
    from sparsecore import table_rows

    return table_rows.export_checks()


def kernel_fingerprint() -> str:
    """What a stored program calling the ops' CPU kernel depends on (:mod:`sparsecore.table_rows`)."""
    from sparsecore import table_rows

    return table_rows.fingerprint()


def overload(name: str) -> torch._ops.OpOverload:
    """The default overload of ``tpu::<name>``."""
    return getattr(torch.ops.tpu, name).default


@functools.cache
def fused_arguments(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(slots, hyperparameters) of the registered ``tpu::`` op ``name``: the argument names its
    schema has between the table and the gradient (the slots it takes and returns after the
    table), and between the gradient and the limits; both empty for an op without them."""
    names = [a.name for a in overload(name)._schema.arguments]
    if "activations_grad" not in names:
        return (), ()
    table, grad, limits = (names.index(k) for k in ("embedding_table", "activations_grad", "device_batch_size"))
    return tuple(names[table + 1:grad]), tuple(names[grad + 1:limits])


# --- the math on the tpu device: jnp off TPU, SparseCore primitives on TPU -----------------------


def _on_tpu_platform() -> bool:
    return not _ON_HOST.is_on() and jax.default_backend() == "tpu"


def dedups_on_host() -> bool:
    """Whether the ops here take ``touched_rows`` computed on the host (off TPU; a TPU's
    SparseCores deduplicate ids themselves)."""
    return not _on_tpu_platform()


def _lookup(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size,
            max_ids_per_partition, max_unique_ids_per_partition, touched_rows=None, output_rows=None,
            num_minibatches=1, devices=1, device_index=0):
    if _on_tpu_platform() and devices == 1:
        from sparsecore import csr_kernels

        out = csr_kernels.sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, embedding_table,
                                              device_batch_size, max_ids_per_partition, max_unique_ids_per_partition,
                                              num_minibatches)
        return out if output_rows is None else out.at[output_rows].set(out, unique_indices=True)
    from sparsecore import csr_math

    return csr_math.sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, embedding_table,
                                        device_batch_size, devices, device_index, touched_rows, output_rows,
                                        num_minibatches)


def _lookup_grad(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                 device_batch_size, max_ids_per_partition, max_unique_ids_per_partition, num_minibatches=1, devices=1,
                 device_index=0):
    from sparsecore import csr_math

    grad, _ = csr_math.table_grad(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                                  devices, device_index, num_minibatches)
    return grad.astype(embedding_table.dtype)


def bind_args(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name (defaults filled in)."""
    schema = overload(name)._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update(zip((a.name for a in schema.arguments), args))
    bound.update(kwargs)
    return bound


def check_inputs(name: str, a: dict[str, Any], read: Any) -> None:
    """Check op ``name``'s bound arguments ``a``: their layout, then (outside
    ``sparsecore_checks.preprocessed``) the CSR buffers' values, read to numpy with ``read``."""
    _check_layout(name, a)
    if checks.values_trusted():
        return
    ints = tuple(read(a[k]) for k in ("row_pointers", "embedding_ids", "sample_ids"))
    stack_rows, batch = a["embedding_table"].shape[0], a["device_batch_size"]
    minibatches = a["num_minibatches"]
    checks.check_values(name, *ints, stack_rows, batch, a["max_ids_per_partition"], a.get("devices", 1), minibatches)
    if a.get("output_rows") is not None:
        checks.check_output_rows(name, read(a["output_rows"]))
    if a.get("grad_rows") is not None:
        checks.check_grad_rows(name, read(a["grad_rows"]), a["activations_grad"].shape[0])
    if a.get("touched_rows") is not None:
        checks.check_touched(name, read(a["touched_rows"]), (*ints, read(a["gains"])), stack_rows, batch,
                             a.get("devices", 1), a.get("device_index", 0), minibatches)


def _check_layout(name: str, a: dict[str, Any]) -> None:
    checks.check_layout(name, a, fused_arguments(name)[0])


def _eager_check(name: str):
    """The check eager dispatch runs on a call's JAX arrays before its lowering."""

    def check(args: tuple, kwargs: dict) -> None:
        check_inputs(name, bind_args(name, args, kwargs), np.asarray)

    return check


def _fused(optimizer: str):
    """The lowering of ``sparse_dense_matmul_grad_with_<optimizer>``."""
    name = f"{FUSED}{optimizer}"
    slots, hyper_names = fused_arguments(name)

    def lowering(*args, **kwargs):
        a = bind_args(name, args, kwargs)
        csr = tuple(a[k] for k in ("row_pointers", "embedding_ids", "sample_ids", "gains"))
        hypers = [a[k] for k in hyper_names]
        table, table_slots, grad = a["embedding_table"], [a[k] for k in slots], a["activations_grad"]
        sharding = (a.get("devices", 1), a.get("device_index", 0))
        if _on_tpu_platform() and sharding[0] == 1:
            from sparsecore import csr_kernels

            limits = (a["device_batch_size"], a["max_ids_per_partition"], a["max_unique_ids_per_partition"])
            if a["grad_rows"] is not None:
                grad = grad[a["grad_rows"]]
            return csr_kernels.fused_update(optimizer, csr, table, table_slots, grad, hypers, *limits,
                                            a["computation_name"] or f"{optimizer}_optimizer_update",
                                            a["num_minibatches"])
        from sparsecore import csr_math

        return csr_math.fused_update(optimizer, *csr, table, table_slots, grad, hypers, *sharding,
                                     touched=a["touched_rows"], grad_rows=a["grad_rows"],
                                     minibatches=a["num_minibatches"])

    return lowering




def touched_rows_ahead(row_pointers: torch.Tensor, embedding_ids: torch.Tensor, sample_ids: torch.Tensor,
                      gains: torch.Tensor, stack_rows: int, device_batch_size: int, fit: bool = True,
                      num_minibatches: int = 1) -> torch.Tensor | None:
    """The ``touched_rows`` argument of the ops for one device's host CSR buffers and a table of
    ``stack_rows`` rows, computed now on the host with numpy (a host tensor; no JAX program, no
    device); None on a TPU, whose SparseCores deduplicate ids themselves. ``fit``: its unique rows
    cut to the bucket the batch needs (``sparsecore.csr_math.fit_touched``); else all of them."""
    if not dedups_on_host():
        return None
    from sparsecore import csr_math

    buffers = [t.numpy() for t in (row_pointers, embedding_ids, sample_ids, gains)]
    phys = csr_math.decode(*buffers, stack_rows, device_batch_size, xp=np, minibatches=num_minibatches)[0]
    touched = csr_math.touched_rows(phys, stack_rows, xp=np)  # numpy: ~4x XLA:CPU's sort
    return torch.from_numpy(csr_math.fit_touched(touched, embedding_ids.shape[0]) if fit else touched)


# --- the CPU kernels: the same XLA formulation, run by JAX on the host ---------------------------------

_ON_HOST = Switch("sparsecore_ops_on_host")


def _on_host(name: str, lowering):
    """The CPU kernel of op ``name``: its inputs checked, then its lowering's XLA formulation on the
    host's CPU device (never the SparseCore primitives, even on a TPU host)."""

    def kernel(*args, **kwargs):
        check_inputs(name, bind_args(name, args, kwargs), lambda t: t.detach().numpy())
        cpu = jax.local_devices(backend="cpu")[0]  # (this process's: a distributed client lists every process's)

        def to_jax(x):
            return jax.device_put(x.detach().numpy(), cpu) if isinstance(x, torch.Tensor) else x

        with _ON_HOST.on(), jax.default_device(cpu):
            out = lowering(*map(to_jax, args), **{k: to_jax(v) for k, v in kwargs.items()})
        return jax.tree.map(lambda y: torch.from_numpy(np.array(y)), out)

    return kernel


# --- fake kernels and autograd -----------------------------------------------------------------------


def _lookup_fake(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size, *_: Any):
    return embedding_table.new_empty((device_batch_size, embedding_table.shape[1]), dtype=torch.float32)


def _lookup_grad_fake(row_pointers, embedding_ids, sample_ids, gains, embedding_table, *_: Any):
    return torch.empty_like(embedding_table)


def _fused_fake(optimizer: str):
    name = f"{FUSED}{optimizer}"
    slots = fused_arguments(name)[0]

    def fake(*args, **kwargs):
        a = bind_args(name, args, kwargs)
        out = (torch.empty_like(a["embedding_table"]), *(torch.empty_like(a[s]) for s in slots))
        return out if len(out) > 1 else out[0]

    return fake


def _layout_checked(name: str, fake):
    """The fake kernel ``fake`` of op ``name`` with the layout checks (every trace runs them)."""

    def checked(*args, **kwargs):
        _check_layout(name, bind_args(name, args, kwargs))
        return fake(*args, **kwargs)

    return checked


def _lookup_positions() -> dict[str, int]:
    """The lookup's argument positions by name, from its schema (autograd passes inputs by position)."""
    schema = torch._C.parse_schema(f"{NAMESPACE}::sparse_dense_matmul{SCHEMAS['sparse_dense_matmul']}")
    return {argument.name: index for index, argument in enumerate(schema.arguments)}


_LOOKUP_AT = _lookup_positions()
_LOOKUP_SAVED = ("row_pointers", "embedding_ids", "sample_ids", "gains", "embedding_table")
_LOOKUP_LIMITS = ("device_batch_size", "max_ids_per_partition", "max_unique_ids_per_partition", "num_minibatches")
_LOOKUP_SHARDING = ("devices", "device_index")


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    rows_at = _LOOKUP_AT["output_rows"]
    output_rows = inputs[rows_at] if len(inputs) > rows_at else None
    ctx.save_for_backward(*(inputs[_LOOKUP_AT[name]] for name in _LOOKUP_SAVED), output_rows)
    ctx.limits = tuple(inputs[_LOOKUP_AT[name]] if len(inputs) > _LOOKUP_AT[name] else 1 for name in _LOOKUP_LIMITS)
    ctx.sharding = {name: inputs[_LOOKUP_AT[name]] for name in _LOOKUP_SHARDING if len(inputs) > _LOOKUP_AT[name]}
    ctx.num_inputs = len(inputs)


def _lookup_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    row_pointers, embedding_ids, sample_ids, gains, embedding_table, output_rows = ctx.saved_tensors
    if output_rows is not None:  # back to activation row order
        grad = grad.index_select(0, output_rows)
    table_grad = torch.ops.tpu.sparse_dense_matmul_grad(row_pointers, embedding_ids, sample_ids, gains,
                                                        embedding_table, grad.contiguous(), *ctx.limits,
                                                        **ctx.sharding)
    grads: list[torch.Tensor | None] = [None] * ctx.num_inputs
    grads[_LOOKUP_AT["embedding_table"]] = table_grad
    return tuple(grads)


def register() -> None:
    """Define the ``tpu::`` SparseCore ops with their CPU, fake and tpu kernels (once)."""
    if _libs:
        return
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    _libs.append(lib)
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
    kernels = {"sparse_dense_matmul": (_lookup, _lookup_fake),
               "sparse_dense_matmul_grad": (_lookup_grad, _lookup_grad_fake)}
    kernels.update({f"{FUSED}{o}": (_fused(o), _fused_fake(o)) for o in OPTIMIZERS})
    for name, (lowering, fake) in kernels.items():
        lib.impl(name, _on_host(name, lowering), "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _layout_checked(name, fake), lib=lib)
        # the math lives in sparsecore: a changed csr_math must not reuse a stored program
        lowering.lowering_sources = LOWERING_SOURCES
        register_lowering(overload(name), check=_eager_check(name))(lowering)
    torch.library.register_autograd(f"{NAMESPACE}::sparse_dense_matmul", _lookup_backward,
                                    setup_context=_setup_context, lib=lib)
    from torch_tpu.ops import sparsecore_dtensor

    sparsecore_dtensor.register(lib)
