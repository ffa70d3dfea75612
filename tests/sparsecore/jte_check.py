"""Our host preprocessing against jax-tpu-embedding's own (byte for byte where it initialises)."""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.csr_format import row_pointers_per_sc
from sparsecore.preprocess import PADDING_ID, preprocess
from sparsecore.validation import feature_inputs


def assert_same_as_jte(plan, kjt, overflow="error", engine="auto"):
    jte_interop = pytest.importorskip("sparsecore.jte_interop", exc_type=ImportError)
    ours = preprocess(kjt, plan, overflow=overflow, engine=engine)
    inputs = feature_inputs(kjt, plan.features, plan.tables)
    pre, stats = jte_interop.jte_preprocess(inputs, plan, allow_id_dropping=overflow == "drop")
    theirs = pre.sparse_dense_matmul_input
    chunks = plan.topology.num_devices * plan.topology.sparsecores_per_device
    for stack in plan.stacks:
        csr = ours.stacks[stack.name]
        pointers = np.asarray(theirs.lhs_row_pointers[stack.name])
        assert pointers.tobytes() == csr.row_pointers.tobytes()
        region = csr.embedding_ids.size // chunks
        width = row_pointers_per_sc(stack)
        for k in range(chunks):
            used = slice(k * region, k * region + int(pointers[(k + 1) * width - 1]))
            tail = slice(used.stop, (k + 1) * region)  # jax-tpu-embedding leaves it uninitialised
            for ours_array, theirs_array in ((csr.embedding_ids, theirs.lhs_embedding_ids),
                                             (csr.sample_ids, theirs.lhs_sample_ids), (csr.gains, theirs.lhs_gains)):
                assert ours_array[used].tobytes() == np.asarray(theirs_array[stack.name])[used].tobytes()
            assert (csr.embedding_ids[tail] == PADDING_ID).all() and np.isnan(csr.gains[tail]).all()
        np.testing.assert_array_equal(csr.stats.max_ids_per_partition, stats.max_ids_per_partition[stack.name])
        np.testing.assert_array_equal(csr.stats.max_unique_ids_per_partition,
                                      stats.max_unique_ids_per_partition[stack.name])
        np.testing.assert_array_equal(csr.stats.required_buffer_size_per_sc,
                                      stats.required_buffer_size_per_sc[stack.name])
        assert csr.stats.dropped_ids == stats.id_drop_counters[stack.name]
    return ours
