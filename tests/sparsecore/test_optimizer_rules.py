"""One record per optimizer (sparsecore.optimizer_rules): every spec has one that agrees with its
TorchTPU op; an optimizer without one fails with the known list; a new one is one registration."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import torch_tpu  # noqa: F401  (defines the tpu:: SparseCore ops)
from sparsecore import optimizers as opt
from sparsecore.backends import make_backend
from sparsecore.optimizer_rules import RULES, OptimizerRule, register, rule_named, rule_of, unregister
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs
from torch_tpu.ops.sparsecore import OPTIMIZERS, fused_arguments, overload

from .helpers import random_kjt


def test_every_spec_has_one_rule_matching_its_op():
    assert set(RULES) == set(opt.OPTIMIZERS.values())
    assert sorted(OPTIMIZERS) == sorted(opt.OPTIMIZERS)  # a fused op per optimizer
    for cls, rule in RULES.items():
        spec = cls()
        slots, hypers = fused_arguments(rule.op_name)
        assert slots == spec.slot_names, cls
        assert len(rule.op_hypers(spec, 1)) == len(hypers), cls
        schema = overload(rule.op_name)._schema.arguments
        tensor_positions = [k for k, name in enumerate(hypers)
                            if isinstance(next(a for a in schema if a.name == name).type, torch.TensorType)]
        assert list(rule.tensors) == tensor_positions, cls  # the program form is the op's
        if rule.in_step:  # fixed hyperparameters: the same with or without the step
            assert rule.op_hypers(spec, None) == rule.op_hypers(spec, 7)
        else:
            with pytest.raises(ValueError, match="step"):
                rule.op_hypers(spec, None)


@dataclass(frozen=True)
class _HalfSGD(opt.SGD):
    name: ClassVar[str] = "half_sgd"


def test_an_optimizer_without_a_rule_names_the_known_ones():
    with pytest.raises(ValueError, match=r"_HalfSGD has no rule; known: SGD, Adagrad, RowWiseAdagrad, Adam, FTRL"):
        rule_of(_HalfSGD())
    with pytest.raises(ValueError, match=r"no optimizer named 'half_sgd'; known: sgd, adagrad, rowwise_adagrad, adam"):
        rule_named("half_sgd")


def test_a_new_optimizer_is_one_registration():
    """SGD at half the rate, registered once, trains on the xla backend: its tables equal plain
    SGD at half the learning rate (an independent run)."""
    register(OptimizerRule(_HalfSGD, lambda rows, slots, grad, hypers, dims: (rows - hypers[0] * grad, ()),
                           lambda spec, step: [spec.learning_rate / 2], varies=(), tensors=(0,), tbe=None,
                           jte=None))
    try:
        results = []
        for spec in (_HalfSGD(0.4), opt.SGD(0.2)):
            tables = [TableSpec("t", 64, 8, "sum", spec)]
            plan = plan_stacking(tables, [FeatureSpec("f", "t", 16)], SparseCoreTopology("v5p", 1))
            weights = {"t": tables[0].init_weights(seed=3)}
            backend = make_backend("xla", plan, weights)
            inputs = feature_inputs(random_kjt(plan, seed=0, max_hot=4, id_range=30), plan.features, plan.tables)
            _, context = backend.forward(inputs)
            backend.backward(context, {"f": torch.randn(16, 8, generator=torch.Generator().manual_seed(1))})
            results.append(backend.table_weights()["t"])
            assert not torch.equal(results[-1], weights["t"])
        torch.testing.assert_close(results[0], results[1])
    finally:
        unregister(_HalfSGD)
