"""Every runnable backend against the dense PyTorch reference: forward, updated weights, slots."""

import pytest
import torch

from sparsecore import optimizers as opt
from sparsecore.backends import make_backend
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs

from .helpers import random_kjt
from .reference import ReferenceModel

OPTIMIZERS = {
    "sgd": opt.SGD(0.1),
    "adagrad": opt.Adagrad(0.1, initial_accumulator_value=0.1),
    "rowwise_adagrad": opt.RowWiseAdagrad(0.1, initial_accumulator_value=0.0, eps=1e-3),
    "adam": opt.Adam(0.05),
    "adam_betas_near_one": opt.Adam(0.05, beta_1=0.99, beta_2=0.99999),
    "ftrl": opt.FTRL(0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.01, beta=0.1),
}


def _plan(optimizer, combiner, topology=SparseCoreTopology("v5p", 2), tb_dim=5):
    tables = [TableSpec("ta", 200, 8, combiner, optimizer), TableSpec("tb", 61, tb_dim, combiner, optimizer),
              TableSpec("tc", 40, 12, combiner, optimizer)]
    features = [FeatureSpec("fa", "ta", 16, weighted=True), FeatureSpec("fb", "tb", 16, weighted=True),
                FeatureSpec("fa2", "ta", 16), FeatureSpec("fc", "tc", 16, weighted=True)]
    return plan_stacking(tables, features, topology)


def _check_against_reference(backend_name, plan, steps=3, atol=2e-5, slot_atol=None):
    weights = {name: spec.init_weights(seed=7) for name, spec in plan.tables.items()}
    backend = make_backend(backend_name, plan, weights)
    reference = ReferenceModel(plan, weights)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        inputs = feature_inputs(random_kjt(plan, seed=step, max_hot=6, id_range=30), plan.features, plan.tables)
        upstream = {f.name: torch.randn(f.batch_size, plan.tables[f.table].dim, generator=gen) for f in plan.features}
        acts, context = backend.forward(inputs)
        expected = reference.step(inputs, upstream)
        for name in expected:
            torch.testing.assert_close(acts[name], expected[name], atol=atol, rtol=1e-5)
        backend.backward(context, upstream)
    got = backend.table_weights()
    for name in plan.tables:
        torch.testing.assert_close(got[name].double(), reference.weights[name], atol=atol, rtol=1e-4)
        assert not torch.equal(got[name], weights[name])  # the update happened
    slots = backend.optimizer_slots()
    for name, table_slots in reference.slots.items():
        for slot, values in table_slots.items():
            torch.testing.assert_close(slots[name][slot].double(), values,
                                       atol=atol if slot_atol is None else slot_atol, rtol=1e-4)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_xla_backend_matches_reference(optimizer):
    _check_against_reference("xla", _plan(OPTIMIZERS[optimizer], "sum"))


def test_xla_adam_slots_follow_the_double_betas():
    """Adam's velocity is (1 - beta_2) g^2 at ~1e-5 scale: relative error, no atol (float32
    betas gave 1 - 0.99999 = 1.0014e-5, 1.4e-3 relative off)."""
    _check_against_reference("xla", _plan(OPTIMIZERS["adam_betas_near_one"], "sum"), slot_atol=1e-12)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_xla_backend_combiners(combiner):
    _check_against_reference("xla", _plan(OPTIMIZERS["adagrad"], combiner, SparseCoreTopology("v6e", 1)))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("combiner", ["sum", "sqrtn"])
def test_fbgemm_backend_matches_reference(optimizer, combiner):
    tb_dim = 4 if optimizer == "rowwise_adagrad" else 5  # FBGEMM averages g^2 over dims padded to 4
    _check_against_reference("fbgemm", _plan(OPTIMIZERS[optimizer], combiner, tb_dim=tb_dim))


def test_fbgemm_rowwise_adagrad_needs_dims_multiple_of_4():
    with pytest.raises(ValueError, match="multiples of 4; tables \\['tb'\\]"):
        make_backend("fbgemm", _plan(OPTIMIZERS["rowwise_adagrad"], "sum"))


@pytest.mark.parametrize("optimizer", ["adam", "ftrl"])
def test_fbgemm_backend_rejects_optimizers_without_cpu_kernel(optimizer):
    with pytest.raises(ValueError, match=f"no fused {optimizer} kernel; use the xla backend"):
        make_backend("fbgemm", _plan(OPTIMIZERS[optimizer], "sum"))


def test_backends_agree_with_each_other_on_mean():
    plan = _plan(OPTIMIZERS["rowwise_adagrad"], "mean", tb_dim=4)
    weights = {name: spec.init_weights(seed=3) for name, spec in plan.tables.items()}
    backends = [make_backend(name, plan, weights) for name in ("xla", "fbgemm")]
    inputs = feature_inputs(random_kjt(plan, seed=5, max_hot=8, id_range=25), plan.features, plan.tables)
    grads = {f.name: torch.ones(f.batch_size, plan.tables[f.table].dim) for f in plan.features}
    for backend in backends:
        _, context = backend.forward(inputs)
        backend.backward(context, grads)
    a, b = (backend.table_weights() for backend in backends)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_wrong_gradient_shape_is_rejected():
    plan = _plan(OPTIMIZERS["sgd"], "sum")
    backend = make_backend("xla", plan)
    _, context = backend.forward(feature_inputs(random_kjt(plan, seed=0), plan.features, plan.tables))
    grads = {f.name: torch.zeros(f.batch_size, plan.tables[f.table].dim) for f in plan.features}
    grads["fb"] = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="feature 'fb': gradient shape \\(16, 8\\) != \\(16, 5\\)"):
        backend.backward(context, grads)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        make_backend("cuda", plan)
    with pytest.raises(ValueError, match="overflow policy must be one of"):
        make_backend("xla", plan, overflow="truncate")


def test_xla_backend_on_real_criteo_sample(criteo_kjt):
    """26 real hashed Criteo features on 26 tables (stacked by dim), one SGD step vs reference."""
    kjt, plan = criteo_kjt
    weights = {name: spec.init_weights(seed=1) for name, spec in plan.tables.items()}
    backend = make_backend("xla", plan, weights)
    reference = ReferenceModel(plan, weights)
    inputs = feature_inputs(kjt, plan.features, plan.tables)
    upstream = {f.name: torch.full((f.batch_size, plan.tables[f.table].dim), 0.5) for f in plan.features}
    acts, context = backend.forward(inputs)
    expected = reference.step(inputs, upstream)
    for name in expected:
        torch.testing.assert_close(acts[name], expected[name])
    backend.backward(context, upstream)
    for name, w in backend.table_weights().items():
        torch.testing.assert_close(w.double(), reference.weights[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend_name, optimizer",
                         [("xla", "adam"), ("xla", "rowwise_adagrad"), ("fbgemm", "adagrad")])
def test_state_round_trip_resumes_training_exactly(backend_name, optimizer):
    plan = _plan(OPTIMIZERS[optimizer], "sum", tb_dim=4)
    grads = {f.name: torch.full((f.batch_size, plan.tables[f.table].dim), 0.3) for f in plan.features}
    batches = [feature_inputs(random_kjt(plan, seed=s, id_range=30), plan.features, plan.tables) for s in range(3)]

    def step(backend, inputs):
        _, context = backend.forward(inputs)
        backend.backward(context, grads)

    original = make_backend(backend_name, plan, seed=2)
    for inputs in batches[:2]:
        step(original, inputs)
    resumed = make_backend(backend_name, plan, seed=99)
    resumed.load_state(original.table_weights(), original.optimizer_slots(), original.steps)
    for backend in (original, resumed):
        step(backend, batches[2])
    for name, w in original.table_weights().items():
        torch.testing.assert_close(resumed.table_weights()[name], w, atol=0, rtol=0)
    bad = original.optimizer_slots()
    next(iter(bad.values()))[plan.tables["ta"].optimizer.slot_names[0]] = torch.zeros(3)
    with pytest.raises(ValueError, match="table 'ta': optimizer slot"):
        resumed.load_state(original.table_weights(), bad)


def test_xla_lookup_reads_only_kept_entries_under_the_drop_policy():
    """Tiny limits force drops; the xla lookup must equal a loop-by-loop reading of the CSR."""
    import numpy as np

    from sparsecore.preprocess import preprocess_inputs
    from sparsecore.stacking import stack_rows

    tables = [TableSpec("t", 256, 8, max_ids_per_partition=8, max_unique_ids_per_partition=8)]
    plan = plan_stacking(tables, [FeatureSpec("f", "t", 32, weighted=True)], SparseCoreTopology("v5p", 1))
    stack = plan.stacks[0]
    backend = make_backend("xla", plan, overflow="drop")
    inputs = feature_inputs(random_kjt(plan, seed=1, max_hot=12), plan.features, plan.tables)
    csr = preprocess_inputs(inputs, plan, overflow="drop").stacks["t"]
    assert csr.stats.dropped_ids > 0
    table = stack_rows(stack, backend.table_weights()).numpy()
    expected = np.zeros((32, 8), dtype=np.float64)
    region, n = csr.embedding_ids.size // 4, stack.num_sparsecores
    kept = 0
    for k in range(4):
        end = 0
        for p in range(n):
            start, end = -(-end // 8) * 8, int(csr.row_pointers[k * 8 + p])
            for j in range(k * region + start, k * region + end):
                row = p * stack.shard_rows + int(csr.embedding_ids[j])
                expected[k * 8 + int(csr.sample_ids[j])] += float(csr.gains[j]) * table[row]
                kept += 1
    assert 0 < kept <= 4 * n * 8  # every partition within its limit of 8
    got = np.asarray(backend.stack_activations(stack, csr))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_package_above_registers_its_backend_by_name():
    import torchrec_tpu.sharding  # noqa: F401  (registers "ops")
    from sparsecore.backends import backend_names, register_backend

    assert set(backend_names()) == {"xla", "fbgemm", "tpu", "ops"}  # every name of the vocabulary
    register_backend("ops", "torchrec_tpu.sharding.ops_backend:OpsBackend")  # the same again: accepted
    with pytest.raises(ValueError, match="backend 'ops' is already torchrec_tpu.sharding.ops_backend:OpsBackend"):
        register_backend("ops", "elsewhere:Other")
    with pytest.raises(ValueError, match=r"backend name 'cuda' is not one of \('xla', 'fbgemm', 'tpu', 'ops'\)"):
        register_backend("cuda", "elsewhere:Other")  # a new name goes into the vocabulary first
    backend = make_backend("ops", _plan(OPTIMIZERS["sgd"], "sum"))
    assert type(backend).__name__ == "OpsBackend" and backend.name == "ops"


def test_ops_before_its_package_registers_it_names_that_package():
    """In a process that has not imported torchrec_tpu.sharding, ``ops`` is a known name whose
    class is not registered yet: the error says who registers it."""
    import subprocess
    import sys

    code = ("from sparsecore.backends import make_backend\n"
            "try:\n    make_backend('ops', None)\nexcept ValueError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "backend 'ops' is registered by torchrec_tpu.sharding: import it first"
