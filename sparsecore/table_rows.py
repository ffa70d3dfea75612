"""Whole-row scatters into a table: the updated rows a batch touched, written back into a table
and its optimizer slots by the SparseCore ops' fused updates (``sparsecore.csr_math``).

XLA:CPU writes a scatter one element at a time: 4 ms to put 26,624 rows of 64 floats back into a
table, 0.8 ms here. On the CPU platform :func:`scatter_rows` lowers to an XLA FFI custom call
(``csrc/table_rows.cc``, one ``memcpy`` a row, in place; built on first use with the system C++
compiler by ``xla_cache.native_build`` and cached); on any other platform (a TPU) and where the
kernel is unavailable (no compiler: one warning) it is XLA's own scatter. The choice is made per
platform at lowering (``jax.lax.platform_dependent``), so one traced program serves both; either
gives the same bits (rows are copied, not computed). Row gathers stay XLA's: it fuses them into
their consumers, and the same kernel reading rows was no faster in the update.

Environment: ``TORCHREC_TPU_ROW_KERNEL=0`` keeps XLA's scatter everywhere.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from tpu_facts import knobs
from xla_cache.native_build import NativeUnavailable, register_cpu_ffi_targets

SOURCE = Path(__file__).with_name("csrc") / "table_rows.cc"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-w")
SCATTER = "SparsecoreScatterRows"


def scatter_rows(table: jax.Array, rows: jax.Array, values: jax.Array, sorted_unique: bool = False) -> jax.Array:
    """``table`` with row ``rows[i]`` replaced by ``values[i]`` (of the table's dtype), as
    ``table.at[rows].set(values, mode="drop")``: a negative row counts from the end, rows outside
    the table are dropped, a row given twice gets one of its values. ``sorted_unique``: the rows
    ascend and repeat none (a hint to XLA's scatter). In place where the table's buffer may be
    reused (donated)."""
    rows = rows.astype(jnp.int32)
    if values.dtype != table.dtype or values.shape != (rows.shape[0], *table.shape[1:]):
        raise ValueError(f"scatter_rows: values {values.dtype}{list(values.shape)} do not fit {rows.shape[0]} rows "
                         f"of a {table.dtype}{list(table.shape)} table")
    hints = dict(indices_are_sorted=True, unique_indices=True) if sorted_unique else {}

    def xla(t, r, v):
        return t.at[r].set(v, mode="drop", **hints)

    if not kernel_available():
        return xla(table, rows, values)
    scatter = jax.ffi.ffi_call(SCATTER, jax.ShapeDtypeStruct(table.shape, table.dtype), input_output_aliases={0: 0})
    return jax.lax.platform_dependent(table, rows, values, cpu=scatter, default=xla)


def kernel_available() -> bool:
    """Whether the CPU kernel is built, loaded and registered with XLA (False: XLA's scatter)."""
    return _register() is None


def export_checks() -> list:
    """What ``jax.export`` must admit for programs calling the kernel (a custom call with no
    compatibility guarantee: stored programs name it in their key, :func:`fingerprint`)."""
    return [jax.export.DisabledSafetyCheck.custom_call(SCATTER)]


def fingerprint() -> str:
    """What a stored program calling the kernel depends on: this module, the kernel's source and
    whether it is in use (a program lowered with it cannot run where it is unavailable)."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + SOURCE.read_bytes()).hexdigest()[:16]
    return f"table_rows={kernel_available()}:{digest}"


@functools.cache
def _register() -> Exception | None:
    """Build, load and register the kernel once per process; the failure (if any) is returned."""
    if not knobs.ROW_KERNEL.on():
        return NativeUnavailable("disabled (TORCHREC_TPU_ROW_KERNEL=0)")  # asked for: no warning
    try:
        register_cpu_ffi_targets(SOURCE, "_sparsecore_table_rows", FLAGS, (SCATTER,))
    except (NativeUnavailable, OSError) as error:
        warnings.warn(f"sparsecore: the CPU row scatter kernel is unavailable, XLA's scatter is used: {error}",
                      RuntimeWarning, stacklevel=2)
        return error
    return None
