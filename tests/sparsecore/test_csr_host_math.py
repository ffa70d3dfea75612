"""The host (numpy) forms of csr_math's decode and deduplication give the bits of the in-program
(jnp) forms: the ops prepare them on the host ahead of the step."""

import jax.numpy as jnp
import numpy as np
import pytest

import torch_tpu  # noqa: F401  (x64 on: the int64 keys of large tables exist)
from sparsecore import csr_math
from sparsecore.csr_format import round_up_array
from tpu_facts import ALIGNMENT


@pytest.mark.parametrize("seed", range(6))
def test_touched_rows_on_the_host_equal_the_program_s(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 400))
    phys = rng.integers(0, rows + 1, int(rng.integers(1, 3000))).astype(np.int32)  # rows: padding
    if seed % 2:
        phys = np.sort(phys)
    host = csr_math.touched_rows(phys, rows, xp=np)
    program = np.asarray(csr_math.touched_rows(jnp.asarray(phys), rows))
    np.testing.assert_array_equal(host, program)
    order, segment, unique = csr_math.split_touched(host, phys.size)
    assert np.array_equal(phys[order], np.sort(phys, kind="stable"))  # (row, position) order
    real = phys[order] < rows
    assert np.array_equal(unique[segment][real], phys[order][real])  # each entry's row, once per row
    assert len(set(unique.tolist())) == unique.size


@pytest.mark.parametrize("n, devices", [(4, 1), (8, 2)])
def test_decode_on_the_host_equals_the_program_s(n: int, devices: int) -> None:
    """Random partition sizes per source region (each partition starting 8-aligned)."""
    rng = np.random.default_rng(n)
    region, batch, stack_rows = 256, 8 * n, 64 * n // devices
    pointers = np.zeros((n, max(n, ALIGNMENT)), np.int32)
    for source in range(n):
        end = 0
        for p in range(n):
            start = int(round_up_array(np.asarray([end]), ALIGNMENT)[0])
            end = start + int(rng.integers(0, (region - start) // (n - p) + 1))
            pointers[source, p] = end
    pointers[:, n:] = pointers[:, n - 1:n]
    ids = rng.integers(0, stack_rows // (n // devices), n * region).astype(np.int32)
    samples = rng.integers(0, batch // n, n * region).astype(np.int32)
    gains = rng.uniform(0.5, 2.0, n * region).astype(np.float32)
    for index in range(devices):
        host = csr_math.decode(pointers.reshape(-1), ids, samples, gains, stack_rows, batch, devices, index, xp=np)
        program = csr_math.decode(*map(jnp.asarray, (pointers.reshape(-1), ids, samples, gains)), stack_rows, batch,
                                  devices, index)
        for a, b in zip(host, program):
            np.testing.assert_array_equal(a, np.asarray(b))
