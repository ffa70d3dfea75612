"""The ops backend cuts each batch's CSR buffers to a bucket of its largest partition (eight per octave):
the cut buffers are byte for byte what preprocessing with that limit builds, and the lookup and
fused update on them (with the update's deduplication done at prepare time) equal those on the
full-size buffers exactly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import Adagrad
from sparsecore.preprocess import preprocess_inputs
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs

pytest.importorskip("torch_tpu")
from sparsecore.csr_sizes import CSR_FIELDS, CsrFitter, bucket_limit, csr_limits, fit_csr, grown, headroom  # noqa: E402
from torchrec_tpu.sharding.ops_backend import OpsBackend, PreparedCSR  # noqa: E402

LIMIT = 200  # not a power of two: a bucket never exceeds it


def _plan(topology: SparseCoreTopology, batch: int):
    adagrad = Adagrad(learning_rate=0.1)
    tables = [TableSpec("t0", 300, 8, "sum", adagrad, max_ids_per_partition=LIMIT, max_unique_ids_per_partition=LIMIT),
              TableSpec("t1", 50, 8, "mean", adagrad, max_ids_per_partition=LIMIT,
                        max_unique_ids_per_partition=LIMIT)]
    features = [FeatureSpec("a", "t0", batch), FeatureSpec("b", "t0", batch), FeatureSpec("c", "t1", batch)]
    limits = dict(stack_to_max_ids_per_partition=lambda name, samples: LIMIT,
                  stack_to_max_unique_ids_per_partition=lambda name, samples: LIMIT // 2)
    return plan_stacking(tables, features, topology, **limits)


def _inputs(plan, step: int, most: int):
    rng = np.random.default_rng(step)
    lengths = [rng.integers(0, most + 1, size=f.batch_size) for f in plan.features]
    values = [rng.integers(0, plan.tables[f.table].vocab_size, size=int(n.sum())) for f, n in zip(plan.features,
                                                                                                  lengths)]
    kjt = KeyedJaggedTensor(keys=[f.name for f in plan.features], values=torch.from_numpy(np.concatenate(values)),
                            lengths=torch.from_numpy(np.concatenate(lengths)).int())
    return feature_inputs(kjt, plan.features, plan.tables, "error")


def test_bucket_limit():
    # eight sizes per power of two, multiples of 8, capped at the configured limit
    assert [bucket_limit(k, 200) for k in (0, 1, 8, 9, 16, 17, 33, 64, 65, 128, 129, 161, 200, 250)] == \
        [8, 8, 8, 16, 16, 24, 40, 64, 72, 128, 144, 176, 200, 200]
    assert bucket_limit(3, 4) == 4 and bucket_limit(0, 8) == 8


@pytest.mark.parametrize("generation,chips", [("v5p", 1), ("v5p", 2)])
@pytest.mark.parametrize("most", [1, 6, 40])
def test_cut_buffers_are_what_preprocessing_with_the_bucket_builds(generation, chips, most):
    topology = SparseCoreTopology(generation, chips)
    plan = _plan(topology, 8 * topology.num_sparsecores)
    chunks = topology.num_sparsecores
    for step in range(3):
        inputs = _inputs(plan, step, most)
        full = preprocess_inputs(inputs, plan)
        for stack in plan.stacks:
            cut = fit_csr(stack, chunks, *(getattr(full.stacks[stack.name], f) for f in CSR_FIELDS))
            limit, unique = csr_limits(stack, chunks, torch.from_numpy(np.ascontiguousarray(cut[1])))
            assert limit == bucket_limit(int(full.stacks[stack.name].stats.max_ids_per_partition.max()), LIMIT)
            assert unique == min(limit, stack.max_unique_ids_per_partition)
            bucketed = replace(plan, stacks=tuple(replace(st, max_ids_per_partition=limit) if st is stack else st
                                                  for st in plan.stacks))
            expected = preprocess_inputs(inputs, bucketed).stacks[stack.name]
            for field, got in zip(CSR_FIELDS, cut):
                want = getattr(expected, field)
                assert got.dtype == want.dtype and np.ascontiguousarray(got).tobytes() == want.tobytes(), field


def test_lookup_and_update_on_cut_buffers_equal_full_ones():
    topology = SparseCoreTopology("v5p", 1)
    plan = _plan(topology, 32)
    cut, full = OpsBackend(plan, seed=3), OpsBackend(plan, seed=3)
    for step, most in enumerate((6, 1, 3)):  # the second batch's update is sized for the first's
        inputs = _inputs(plan, step, most)
        batch = preprocess_inputs(inputs, plan)
        whole = PreparedCSR(tuple(torch.from_numpy(getattr(batch.stacks[st.name], f))
                                  for st in plan.stacks for f in CSR_FIELDS), batch.stats)
        prepared = cut.prepare(inputs)  # with grad: its update's deduplication done here, on the host
        assert sum(t.numel() for t in prepared.csr) < sum(t.numel() for t in whole.csr)
        assert len(prepared.touched) == len(plan.stacks) and not whole.touched
        with torch.no_grad():  # (evaluation: no update follows)
            assert not cut.prepare(inputs).touched
        got, _ = cut.forward(prepared)
        want, _ = full.forward(whole)
        grads = {}
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)
            grads[name] = torch.from_numpy(np.random.default_rng(step).normal(size=value.shape).astype(np.float32))
        cut.backward(prepared, grads)
        full.backward(whole, grads)
    for name, value in full.table_weights().items():
        torch.testing.assert_close(cut.table_weights()[name], value, rtol=0, atol=0)
    for name, slots in full.optimizer_slots().items():
        for slot, value in slots.items():
            torch.testing.assert_close(cut.optimizer_slots()[name][slot], value, rtol=0, atol=0)


def test_update_sizes_never_shrink():
    """The CSR buffers and the rows an update is sized for (the touched vector's length) only grow:
    batches whose counts straddle a bucket would otherwise alternate between two step programs."""
    topology = SparseCoreTopology("v5p", 1)
    plan = _plan(topology, 32)
    backend = OpsBackend(plan, seed=0)
    prepared = [backend.prepare(_inputs(plan, step, most)) for step, most in enumerate((1, 40, 1, 6))]
    sizes = [[t.numel() for t in (*p.csr, *p.touched)] for p in prepared]
    assert sizes[1] > sizes[0] and sizes[2] == sizes[1] and sizes[3] == sizes[1], sizes


def test_grown_keeps_a_size_that_fits_and_grows_past_the_need_with_headroom():
    assert [headroom(n) for n in (0, 1, 100, 4096, 10_000)] == [0, 4, 40, 256, 625]  # 4 sqrt(n), >= n / 16
    bucket = lambda n: bucket_limit(n, 4096)  # noqa: E731
    assert grown(0, 100, bucket) == 144  # bucket(100 + 40)
    assert grown(144, 130, bucket) == 144  # bucket(130) == 144 fits
    assert grown(144, 145, bucket) == 208  # bucket(145 + 49)
    assert grown(4000, 4096, bucket) == 4096  # never past the configured limit


def test_a_random_stream_settles_in_its_first_batches():
    """Over a stream of batches whose per-partition ids and distinct rows vary (Zipf ids, random
    lengths: as Criteo's), the fitter's sizes stop growing after the first batches: each growth
    compiles the step program again, inside the run's timed steady state."""
    topology = SparseCoreTopology("v5p", 1)
    adagrad = Adagrad(learning_rate=0.1)
    tables = [TableSpec(f"t{i}", 20_000, 8, "sum", adagrad, max_ids_per_partition=4096,
                        max_unique_ids_per_partition=4096) for i in range(2)]
    batch = 256 * topology.num_sparsecores
    features = [FeatureSpec(f"f{i}", f"t{i % 2}", batch) for i in range(6)]
    plan = plan_stacking(tables, features, topology, stack_to_max_ids_per_partition=lambda name, samples: 4096,
                         stack_to_max_unique_ids_per_partition=lambda name, samples: 4096)
    fitter = CsrFitter(plan)
    rng = np.random.default_rng(0)
    sizes = []
    for _ in range(60):
        lengths = [rng.integers(0, 4, size=batch) for _ in features]
        values = [(rng.zipf(1.05, size=int(n.sum())) - 1) % 20_000 for n in lengths]
        kjt = KeyedJaggedTensor(keys=[f.name for f in features], values=torch.from_numpy(np.concatenate(values)),
                                lengths=torch.from_numpy(np.concatenate(lengths)).int())
        csr = fitter.cut(preprocess_inputs(feature_inputs(kjt, plan.features, plan.tables, "error"), plan))
        sizes.append([b.shape[0] for buffers in csr for b in buffers] + [t.shape[0] for t in fitter.touched(csr)])
    needs_cut = sizes[0][1] < 4096 * topology.num_sparsecores ** 2  # the sizes are cut, not the full layout
    assert needs_cut and all(s == sizes[-1] for s in sizes[1:]), [i for i in range(1, 60) if sizes[i] != sizes[i - 1]]
