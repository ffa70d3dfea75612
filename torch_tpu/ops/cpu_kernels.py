"""The device's own XLA:CPU kernels (FFI custom calls built on first use): what a stored program
calling them depends on, and what ``jax.export`` must admit for it. The kernels: the batched small
matmul (:mod:`~torch_tpu.ops.batched_matmul`), the 2-D GEMM on torch's MKL
(:mod:`~torch_tpu.ops.host_gemm`) and the SparseCore updates' row scatter (``sparsecore.table_rows``)."""

from __future__ import annotations

from torch_tpu.ops import batched_matmul, host_gemm
from torch_tpu.ops import sparsecore as sparsecore_ops


def fingerprint() -> str:
    """Every kernel's sources and whether it is in use (a program lowered with a kernel cannot run
    where it is unavailable): part of every stored program's key."""
    return ";".join((batched_matmul.fingerprint(), host_gemm.fingerprint(), sparsecore_ops.kernel_fingerprint()))


def export_checks() -> list:
    """The custom calls ``jax.export`` must admit (they have no compatibility guarantee; stored
    programs name them in their key through :func:`fingerprint`)."""
    return [*batched_matmul.export_checks(), *host_gemm.export_checks(), *sparsecore_ops.kernel_export_checks()]
