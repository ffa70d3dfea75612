"""The xla backend's fast paths against what they replace: row-ordered entries equal the CSR
buffers' entries, the compiled all-stack programs equal a lookup that reads the CSR buffers bit
for bit, and mixed batch sizes (per-feature outputs) train like the dense reference; the learning
rate is an input of the compiled update, so a warmup changes it each step without a recompile."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from sparsecore import optimizers as opt
from sparsecore.backends import make_backend
from sparsecore.csr_math import row_ordered
from sparsecore.preprocess import preprocess_inputs, preprocess_row_ordered
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import FeatureInput, feature_inputs
from tpu_facts import quarter_bucket

from .helpers import random_kjt
from .reference import ReferenceModel


def _plan(combiner="sum", limit=256, topology=SparseCoreTopology("v5p", 2), batch=(16, 16)):
    limits = dict(max_ids_per_partition=limit, max_unique_ids_per_partition=limit)
    tables = [TableSpec("ta", 200, 8, combiner, **limits), TableSpec("tb", 61, 5, combiner, **limits),
              TableSpec("tc", 40, 12, combiner, **limits)]
    features = [FeatureSpec("fa", "ta", batch[0], weighted=True), FeatureSpec("fb", "tb", batch[1], weighted=True),
                FeatureSpec("fa2", "ta", batch[0]), FeatureSpec("fc", "tc", batch[1], weighted=True)]
    return plan_stacking(tables, features, topology)


@pytest.mark.parametrize("combiner, limit, overflow", [("sum", 256, "error"), ("sqrtn", 256, "error"),
                                                        ("mean", 4, "drop")])
def test_row_ordered_entries_are_the_csr_entries_by_row(combiner, limit, overflow):
    plan = _plan(combiner, limit)
    inputs = feature_inputs(random_kjt(plan, seed=3, max_hot=9, id_range=40), plan.features, plan.tables)
    csr = preprocess_inputs(inputs, plan, overflow=overflow)
    rows = preprocess_row_ordered(inputs, plan, overflow=overflow)
    for stack in plan.stacks:
        want = row_ordered(csr.stacks[stack.name], stack.vocab_size, stack.total_sample_count)
        got = rows[stack.name]
        np.testing.assert_array_equal(got.phys, want.phys)
        np.testing.assert_array_equal(got.sample, want.sample)
        assert got.gain.tobytes() == want.gain.tobytes()
        expected = csr.stacks[stack.name].stats
        for field in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
            np.testing.assert_array_equal(getattr(got.stats, field), getattr(expected, field))
        assert got.stats.dropped_ids == expected.dropped_ids
    if overflow == "drop":
        assert sum(s.dropped_ids for s in csr.stats.values()) > 0


def test_compiled_lookup_equals_reading_the_csr_buffers_bit_for_bit():
    plan = _plan("mean", topology=SparseCoreTopology("v6e", 1))
    backend = make_backend("xla", plan, seed=4)
    inputs = feature_inputs(random_kjt(plan, seed=8, max_hot=7, id_range=30), plan.features, plan.tables)
    out, _ = backend.lookup(backend.prepare(inputs))
    csr = preprocess_inputs(inputs, plan)
    per_feature = {}
    for stack in plan.stacks:
        stacked = np.asarray(backend.stack_activations(stack, csr.stacks[stack.name]))
        chunks = plan.topology.num_sparsecores
        for fp in stack.features:
            i = np.arange(fp.samples)
            per_chunk = fp.samples // chunks
            rows = (i // per_chunk) * (stack.total_sample_count // chunks) + fp.sample_offset // chunks + i % per_chunk
            per_feature[fp.feature] = stacked[rows, : plan.tables[fp.table].dim]
    expected = np.concatenate([per_feature[f.name] for f in plan.features], axis=1)
    assert out.numpy().tobytes() == expected.tobytes()


@pytest.mark.parametrize("optimizer",
                         [opt.Adam(0.05), opt.RowWiseAdagrad(0.1, initial_accumulator_value=0.0, eps=1e-3)])
def test_mixed_batch_sizes_train_like_the_reference(optimizer):
    plan = _plan(batch=(16, 32), topology=SparseCoreTopology("v5p", 1))
    tables = [TableSpec(t.name, t.vocab_size, t.dim, t.combiner, optimizer) for t in plan.tables.values()]
    plan = plan_stacking(tables, list(plan.features), plan.topology)
    weights = {name: spec.init_weights(seed=2) for name, spec in plan.tables.items()}
    backend, reference = make_backend("xla", plan, weights), ReferenceModel(plan, weights)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        inputs = _mixed_inputs(plan, seed=step)
        upstream = {f.name: torch.randn(f.batch_size, plan.tables[f.table].dim, generator=gen) for f in plan.features}
        acts, context = backend.forward(inputs)
        for name, expected in reference.step(inputs, upstream).items():
            torch.testing.assert_close(acts[name], expected, atol=2e-5, rtol=1e-5)
        backend.backward(context, upstream)
    for name, w in backend.table_weights().items():
        torch.testing.assert_close(w.double(), reference.weights[name], atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="one batch size for all features"):
        backend.lookup(inputs)


def _mixed_inputs(plan, seed: int) -> dict[str, FeatureInput]:
    """Per-feature inputs of each feature's own batch size (a single KJT cannot mix them)."""
    rng = np.random.default_rng(seed)
    out = {}
    for f in plan.features:
        lengths = rng.integers(0, 5, size=f.batch_size)
        ids = rng.integers(0, min(25, plan.tables[f.table].vocab_size), size=int(lengths.sum()))
        out[f.name] = FeatureInput(ids, lengths, rng.uniform(0.5, 1.5, size=ids.size).astype(np.float32))
    return out


def test_buckets_are_few_and_tight():
    sizes = [quarter_bucket(n) for n in range(1, 20_000)]
    assert all(s >= n for n, s in zip(range(1, 20_000), sizes))
    assert all(s <= max(64, 1.25 * n) for n, s in zip(range(1, 20_000), sizes))
    assert len(set(sizes)) <= 4 * 9 + 1


@pytest.mark.parametrize("optimizer", [opt.Adagrad(0.1, initial_accumulator_value=0.1), opt.Adam(0.05)])
def test_update_reading_the_output_gradient_rows_equals_the_per_feature_slices(optimizer):
    """One dim everywhere and the features' stacks interleaved (sum and mean stacks): the update
    gathers its rows straight from the output gradient; it trains bit for bit like the update
    from per-feature slices of it, and like the dense reference."""
    tables = [TableSpec(name, vocab, 8, combiner, optimizer) for name, vocab, combiner in
              (("ta", 200, "sum"), ("tb", 61, "mean"), ("tc", 40, "sum"), ("td", 90, "mean"))]
    features = [FeatureSpec("fb", "tb", 16, weighted=True), FeatureSpec("fa", "ta", 16, weighted=True),
                FeatureSpec("fd", "td", 16), FeatureSpec("fa2", "ta", 16), FeatureSpec("fc", "tc", 16)]
    plan = plan_stacking(tables, features, SparseCoreTopology("v5p", 2))
    weights = {name: spec.init_weights(seed=3) for name, spec in plan.tables.items()}
    direct, sliced, reference = make_backend("xla", plan, weights), make_backend("xla", plan, weights), \
        ReferenceModel(plan, weights)
    assert len(plan.stacks) == 2 and direct._layout.row_view and not direct._layout.concatenated
    sliced._layout.row_view = False  # the general path: per-feature slices of the gradient
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        inputs = feature_inputs(random_kjt(plan, seed=20 + step, max_hot=5, id_range=25), plan.features, plan.tables)
        grad = torch.randn(16, 8 * len(features), generator=gen)
        upstream = dict(zip([f.name for f in plan.features], grad.split(8, dim=1)))
        reference.step(inputs, upstream)
        for backend in (direct, sliced):
            _, context = backend.lookup(backend.prepare(inputs))
            backend.update(context, grad)
    for name, w in direct.table_weights().items():
        assert w.numpy().tobytes() == sliced.table_weights()[name].numpy().tobytes()
        torch.testing.assert_close(w.double(), reference.weights[name], atol=2e-5, rtol=1e-4)
    for name, table_slots in direct.optimizer_slots().items():
        for slot, values in table_slots.items():
            assert values.numpy().tobytes() == sliced.optimizer_slots()[name][slot].numpy().tobytes()



def _plan_at(optimizer):
    """The plan of three tables (two stacks) and four features, every table at ``optimizer``."""
    tables = [TableSpec(name, vocab, dim, "sum", optimizer, max_ids_per_partition=256,
                        max_unique_ids_per_partition=256) for name, vocab, dim in (("ta", 200, 8), ("tb", 61, 5),
                                                                                   ("tc", 40, 12))]
    features = [FeatureSpec("fa", "ta", 16, weighted=True), FeatureSpec("fb", "tb", 16, weighted=True),
                FeatureSpec("fa2", "ta", 16), FeatureSpec("fc", "tc", 16, weighted=True)]
    return plan_stacking(tables, features, SparseCoreTopology("v5p", 2))


@pytest.mark.slow  # 3-8 s each: the programs compile
@pytest.mark.parametrize("optimizer", [opt.RowWiseAdagrad(0.1), opt.Adam(0.05), opt.SGD(0.2)])
def test_a_scaled_learning_rate_updates_at_that_rate_without_recompiling(optimizer):
    """A warmup's steps (rates x 1/4, 1/2, 1) on one backend: its first step is bit for bit a
    backend's built at the quarter rate, all three train like the dense reference stepping at those
    rates, and a batch's programs are not compiled again at another rate."""
    plan = _plan_at(optimizer)
    weights = {name: spec.init_weights(seed=4) for name, spec in plan.tables.items()}
    warm, reference = make_backend("xla", plan, weights), ReferenceModel(plan, weights)
    quarter = make_backend("xla", _plan_at(replace(optimizer, learning_rate=optimizer.learning_rate / 4)), weights)
    gen = torch.Generator().manual_seed(6)
    for step, scale in enumerate((0.25, 0.5, 1.0)):
        inputs = feature_inputs(random_kjt(plan, seed=30 + step, max_hot=4, id_range=30), plan.features, plan.tables)
        grad = torch.randn(16, 8 + 5 + 8 + 12, generator=gen)
        warm.set_learning_rate_scale(scale)
        _, context = warm.lookup(warm.prepare(inputs))
        warm.update(context, grad)
        reference.plan = _plan_at(replace(optimizer, learning_rate=optimizer.learning_rate * scale))
        reference.step(inputs, dict(zip([f.name for f in plan.features], grad.split([8, 5, 8, 12], dim=1))))
        if step == 0:
            _, context = quarter.lookup(quarter.prepare(inputs))
            quarter.update(context, grad)
            for name, w in warm.table_weights().items():
                assert w.numpy().tobytes() == quarter.table_weights()[name].numpy().tobytes(), name
    for name, w in warm.table_weights().items():
        torch.testing.assert_close(w.double(), reference.weights[name], atol=2e-5, rtol=1e-4)
    compiled = len(warm._programs)
    warm.set_learning_rate_scale(0.75)  # the first batch again at another rate: no new program
    _, context = warm.lookup(warm.prepare(feature_inputs(random_kjt(plan, seed=30, max_hot=4, id_range=30),
                                                         plan.features, plan.tables)))
    warm.update(context, torch.zeros(16, 8 + 5 + 8 + 12))
    assert len(warm._programs) == compiled
    with pytest.raises(ValueError, match=r"learning-rate scale 0\.0: it must be > 0"):
        warm.set_learning_rate_scale(0.0)
