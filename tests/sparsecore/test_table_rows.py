"""The fused updates' row scatter kernel against XLA's scatter (the reference), and its fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsecore import csr_math
from sparsecore.table_rows import SCATTER, kernel_available, scatter_rows

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler: the kernel is not built")


def _xla_scatter(table, rows, values):
    return table.at[rows].set(values, mode="drop")


@pytest.mark.parametrize("dtype,row_shape", [(jnp.float32, (16,)), (jnp.bfloat16, (8,)), (jnp.int32, (3, 5)),
                                             (jnp.float32, (64,))])
def test_writes_what_xlas_scatter_writes_dropping_rows_outside_the_table(dtype, row_shape) -> None:
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.integers(-9, 9, (50, *row_shape))).astype(dtype)
    rows = jnp.asarray(np.concatenate([rng.permutation(49)[:20], [50, 77, -1]]).astype(np.int32))  # -1: row 49
    values = jnp.asarray(rng.integers(-9, 9, (23, *row_shape))).astype(dtype)
    got = jax.jit(scatter_rows)(table, rows, values)
    assert got.dtype == table.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_xla_scatter(table, rows, values)))


def test_in_place_when_donated_and_a_copy_when_not() -> None:
    table = jnp.arange(40, dtype=jnp.float32).reshape(10, 4)
    rows, values = jnp.array([7, 2], jnp.int32), -jnp.ones((2, 4), jnp.float32)
    kept = np.asarray(table).copy()
    copied = jax.jit(scatter_rows)(table, rows, values)
    np.testing.assert_array_equal(np.asarray(table), kept)  # not donated: the input is untouched
    donated = jax.jit(scatter_rows, donate_argnums=0)(table + 0, rows, values)
    np.testing.assert_array_equal(np.asarray(donated), np.asarray(copied))
    assert table.is_deleted() is False


def test_sorted_unique_rows_give_the_same_table() -> None:
    table = jnp.zeros((12, 2), jnp.float32)
    rows = jnp.array([1, 4, 9, 12, 13], jnp.int32)  # ascending; the last two past the table
    values = jnp.arange(10, dtype=jnp.float32).reshape(5, 2)
    np.testing.assert_array_equal(np.asarray(scatter_rows(table, rows, values, sorted_unique=True)),
                                  np.asarray(_xla_scatter(table, rows, values)))


def test_values_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match=r"values bfloat16\[2, 4\] do not fit 2 rows of a float32\[10, 4\] table"):
        scatter_rows(jnp.zeros((10, 4), jnp.float32), jnp.array([0, 1]), jnp.zeros((2, 4), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"do not fit 3 rows"):
        scatter_rows(jnp.zeros((10, 4)), jnp.array([0, 1, 2]), jnp.zeros((2, 4)))


def test_the_cpu_lowering_calls_the_kernel_and_the_tpu_one_xlas_scatter() -> None:
    args = (jnp.zeros((10, 4)), jnp.array([0, 1], jnp.int32), jnp.ones((2, 4)))
    lowered = jax.jit(scatter_rows).trace(*args)
    assert SCATTER in lowered.lower(lowering_platforms=("cpu",)).as_text()
    tpu_text = lowered.lower(lowering_platforms=("tpu",)).as_text()
    assert SCATTER not in tpu_text and "stablehlo.scatter" in tpu_text


def test_the_fused_update_writes_through_the_kernel() -> None:
    """Adagrad over a batch's rows: the kernel's program equals the same update written with XLA's
    scatter (the rule's rows put back by hand)."""
    rng = np.random.default_rng(1)
    stack_rows, dim, entries = 64, 8, 24
    ids = np.sort(rng.integers(0, stack_rows, entries)).astype(np.int32)
    buffers = [jnp.asarray(x) for x in (np.full(8, entries, np.int32), ids, rng.permutation(entries).astype(np.int32),
                                        np.ones(entries, np.float32))]
    table, slot = jnp.asarray(rng.standard_normal((stack_rows, dim), np.float32)), jnp.full((stack_rows, dim), 0.1)
    grad = jnp.asarray(rng.standard_normal((entries, dim), np.float32))
    update = jax.jit(lambda *a: csr_math.fused_update("adagrad", *a[:4], a[4], (a[5],), a[6], (0.05, 1e-8)))
    assert SCATTER in update.lower(*buffers, table, slot, grad).as_text()
    new_table, new_slot = update(*buffers, table, slot, grad)
    dense_grad, touched = csr_math.table_grad(*buffers, table, grad)
    want_slot = np.where(np.asarray(touched)[:, None], np.asarray(slot) + np.asarray(dense_grad) ** 2, np.asarray(slot))
    np.testing.assert_allclose(np.asarray(new_slot), want_slot, rtol=1e-6)
    untouched = ~np.asarray(touched)
    np.testing.assert_array_equal(np.asarray(new_table)[untouched], np.asarray(table)[untouched])


CHECK = """
import warnings; warnings.simplefilter("always")
import jax.numpy as jnp, numpy as np
from sparsecore.table_rows import kernel_available, scatter_rows
got = scatter_rows(jnp.zeros((4, 2)), jnp.array([2, 9]), jnp.ones((2, 2)))
np.testing.assert_array_equal(np.asarray(got), [[0, 0], [0, 0], [1, 1], [0, 0]])
print("kernel", kernel_available())
"""


def _run_isolated(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_without_a_compiler_xlas_scatter_runs_with_one_warning(tmp_path) -> None:
    done = _run_isolated(CXX=str(tmp_path / "no-such-compiler"), TORCHREC_TPU_NATIVE_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "kernel False" in done.stdout
    assert done.stderr.count("row scatter kernel is unavailable") == 1, done.stderr


@pytest.mark.slow
def test_the_kernel_can_be_switched_off() -> None:
    done = _run_isolated(TORCHREC_TPU_ROW_KERNEL="0")
    assert done.returncode == 0, done.stderr
    assert "kernel False" in done.stdout and "unavailable" not in done.stderr
