"""The tpu backend's programs lower to jax-tpu-embedding's SparseCore custom calls (they can
only execute on a TPU); on this machine constructing the backend fails with a clear error."""

import pytest

pytest.importorskip("jax_tpu_embedding")

from sparsecore import optimizers as opt  # noqa: E402
from sparsecore.backends import make_backend  # noqa: E402
from sparsecore.backends.tpu import lowered_programs  # noqa: E402
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec  # noqa: E402
from sparsecore.stacking import plan_stacking  # noqa: E402


def _plan(optimizer, topology=SparseCoreTopology("v5p", 1)):
    tables = [TableSpec("a", 1000, 16, "mean", optimizer), TableSpec("b", 100, 12, "mean", optimizer)]
    return plan_stacking(tables, [FeatureSpec("fa", "a", 32), FeatureSpec("fb", "b", 32)], topology)


@pytest.mark.parametrize("optimizer, slots", [
    (opt.SGD(0.1), 0), (opt.Adagrad(0.1), 1), (opt.Adam(0.01), 2), (opt.FTRL(0.1), 2)])
def test_programs_lower_to_sparsecore_custom_calls(optimizer, slots):
    plan = _plan(optimizer)
    forward, backward = lowered_programs(plan, "a_b")
    assert "custom_call @SparseDenseMatmulOp" in forward
    assert "DEVICE_TYPE_SPARSECORE" in forward and "max_ids_per_partition" in forward
    assert "custom_call @SparseDenseMatmulGradOpWithOptimizerUpdate" in backward
    assert f"{optimizer.name}-a_b" in backward  # the optimizer's update computation, named per stack
    # updated table + slots come back from one fused call
    assert backward.count("stablehlo.get_tuple_element") == 1 + slots


def test_rowwise_adagrad_has_no_sparsecore_kernel():
    with pytest.raises(ValueError, match="no RowWiseAdagrad SparseCore kernel; use the xla or fbgemm backend"):
        lowered_programs(_plan(opt.RowWiseAdagrad(0.1)), "a_b")


def test_backend_needs_tpu_devices():
    with pytest.raises(RuntimeError, match="needs 1 TPU devices .* use backend='xla'"):
        make_backend("tpu", _plan(opt.SGD(0.1)))


def test_stacked_activation_layout_matches_jax_tpu_embedding_unstacking():
    """The xla backend's stacked activations, unstacked by jax-tpu-embedding's own code, give the
    xla backend's per-feature outputs: both backends share one activation layout."""
    import numpy as np
    from jax_tpu_embedding.sparsecore.lib.nn import embedding

    from sparsecore.jte_interop import jte_feature_specs
    from sparsecore.preprocess import preprocess_inputs
    from sparsecore.validation import feature_inputs

    from .helpers import random_kjt

    tables = [TableSpec("a", 300, 16), TableSpec("b", 90, 12)]
    features = [FeatureSpec("fa", "a", 32), FeatureSpec("fb", "b", 32), FeatureSpec("fa2", "a", 32)]
    plan = plan_stacking(tables, features, SparseCoreTopology("v5p", 1))
    backend = make_backend("xla", plan)
    inputs = feature_inputs(random_kjt(plan, seed=4, max_hot=5), plan.features, plan.tables)
    ours, _ = backend.forward(inputs)
    batch = preprocess_inputs(inputs, plan)
    stacked = {s.name: backend.stack_activations(s, batch.stacks[s.name]) for s in plan.stacks}
    theirs = embedding.unstack_embedding_activations(stacked, jte_feature_specs(plan), 1, 4)
    for name, activation in ours.items():
        np.testing.assert_array_equal(np.asarray(theirs[name]), activation.numpy())


@pytest.mark.parametrize("optimizer", [opt.SGD(0.1), opt.Adagrad(0.1)])
def test_minibatching_programs_carry_the_minibatch_count(optimizer):
    """Under overflow="minibatch" the kernels are jax-tpu-embedding's minibatching forms, whose
    minibatch count is an input of the program, passed to the custom call."""
    forward, backward = lowered_programs(_plan(optimizer), "a_b", minibatching=True)
    for text, target in ((forward, "SparseDenseMatmulWithMinibatchingOp"),
                         (backward, "SparseDenseMatmulGradOptimizerUpdateWithMinibatchingOp")):
        assert f"custom_call @{target}" in text
        call = next(line for line in text.splitlines() if f"custom_call @{target}" in line)
        assert "tensor<i32>" in call.partition("->")[0].partition(":")[2]  # the count, an operand
    assert "@SparseDenseMatmulOp" not in forward and "GradOpWithOptimizerUpdate" not in backward
    one_pass_forward, _ = lowered_programs(_plan(optimizer), "a_b")
    assert "WithMinibatchingOp" not in one_pass_forward
