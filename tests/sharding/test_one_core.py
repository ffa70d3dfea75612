"""One SparseCore core: the xla backend's step programs and the ops backend's tpu:: SparseCore ops
run the same lookup and update (sparsecore.entries) on the record each producer makes (host row
order; the cut CSR buffers decoded), so their lookups, tables and optimizer slots are equal bit for bit
over several steps, for every optimizer (Adam's within float rounding: ``_assert_equal_rows``)."""

import numpy as np
import pytest
import torch

from sparsecore import optimizers as opt
from sparsecore.backends import make_backend
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs
from tests.sparsecore.helpers import random_kjt, step_alike

pytest.importorskip("torch_tpu")
import torchrec_tpu.sharding  # noqa: E402,F401  (registers the ops backend)

OPTIMIZERS = [opt.SGD(0.1), opt.Adagrad(0.1, initial_accumulator_value=0.1),
              opt.RowWiseAdagrad(0.1, initial_accumulator_value=0.0, eps=1e-3), opt.Adam(0.05),
              opt.FTRL(0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.01, beta=0.1)]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_xla_and_ops_backends_agree_bit_for_bit(optimizer: opt.OptimizerSpec) -> None:
    tables = [TableSpec("ta", 200, 8, "sum", optimizer), TableSpec("tb", 61, 8, "mean", optimizer),
              TableSpec("tc", 40, 8, "sum", optimizer)]
    features = [FeatureSpec("fa", "ta", 16, weighted=True), FeatureSpec("fb", "tb", 16),
                FeatureSpec("fa2", "ta", 16), FeatureSpec("fc", "tc", 16, weighted=True)]
    plan = plan_stacking(tables, features, SparseCoreTopology("v5p", 2))
    weights = {name: spec.init_weights(seed=3) for name, spec in plan.tables.items()}
    backends = [make_backend(name, plan, weights) for name in ("xla", "ops")]
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        inputs = feature_inputs(random_kjt(plan, seed=step, max_hot=7, id_range=30), plan.features, plan.tables)
        grads = {f.name: torch.randn(f.batch_size, 8, generator=gen) for f in plan.features}
        step_alike(backends, inputs, grads, step)
    (xla_tables, ops_tables), (xla_slots, ops_slots) = ([b.table_weights() for b in backends],
                                                        [b.optimizer_slots() for b in backends])
    for name in plan.tables:
        assert not torch.equal(xla_tables[name], weights[name])  # trained
        _assert_equal_rows(xla_tables[name].numpy(), ops_tables[name].numpy(), optimizer)
        for slot in optimizer.slot_names:
            _assert_equal_rows(xla_slots[name][slot].numpy(), ops_slots[name][slot].numpy(), optimizer)


def _assert_equal_rows(xla: np.ndarray, ops: np.ndarray, optimizer: opt.OptimizerSpec) -> None:
    """Bit for bit, but for Adam's rule: on CPU its rows reach the table through the row scatter
    kernel (``sparsecore.table_rows``), so XLA compiles the rule as a fusion of its own in each
    program, and the ops' program (hyperparameters constant) and the xla backend's (some traced)
    round an element a few ulps apart (the steps after carry it)."""
    if isinstance(optimizer, opt.Adam):
        np.testing.assert_allclose(ops, xla, rtol=1e-6, atol=0)
    else:
        np.testing.assert_array_equal(xla, ops)
