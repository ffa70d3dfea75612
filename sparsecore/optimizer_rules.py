"""One record per SparseCore optimizer: what every engine does with it, looked up by spec type.

A :class:`OptimizerRule` says, for one :class:`~sparsecore.optimizers.OptimizerSpec` class (its
slots and hyperparameters are the class's own): its update on a stack's gathered touched rows (the
``xla`` backend's), the hyperparameters its TorchTPU op ``tpu::sparse_dense_matmul_grad_with_<name>``
takes after the gradient (the ``ops`` backend's) and whether they are fixed, so that a traced step
program can run the update; FBGEMM's fused TBE kernel and jax-tpu-embedding's optimizer spec for it
(None: no such kernel). Each record is registered right below its update, as jax's ``lax`` keeps a
rule beside its primitive: a new optimizer is its spec class plus one update and record here.

The update formulas follow jax-tpu-embedding's SparseCore kernels; ``grad`` is the gradient of
each touched row already summed over all its occurrences in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from sparsecore import optimizers as opt

# (spec, rows, slots, grad, step, row_dims) -> (new rows, new slots)
Update = Callable[..., tuple[jnp.ndarray, dict[str, jnp.ndarray]]]


@dataclass(frozen=True)
class OptimizerRule:
    """Everything the engines do with one optimizer spec class (see the module docstring).

    ``op_hypers(spec, step)``: the fused op's hyperparameters after its gradient, in its schema's
    order (``step``: the update's number from 1, None inside a step program); ``in_step``: they do
    not depend on the step. ``tbe(spec)``: ``(EmbOptimType member, eps)`` of FBGEMM's kernel, or None
    where it has none. ``jte(spec)``: ``(class name in jax_tpu_embedding's embedding_spec, its
    arguments)``, or None where it has no such kernel (it raises for unsupported settings)."""

    spec: type[opt.OptimizerSpec]
    update: Update
    op_hypers: Callable[[Any, int | None], list[float]]
    in_step: bool
    tbe: Callable[[Any], tuple[str, float]] | None
    jte: Callable[[Any], tuple[str, tuple[Any, ...]]] | None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def op_name(self) -> str:
        """The fused TorchTPU op (in ``torch.ops.tpu``)."""
        return f"sparse_dense_matmul_grad_with_{self.name}"


RULES: dict[type[opt.OptimizerSpec], OptimizerRule] = {}


def register(rule: OptimizerRule) -> OptimizerRule:
    """Add ``rule`` (one per spec class)."""
    if rule.spec in RULES:
        raise ValueError(f"optimizer {rule.spec.__name__} already has a rule")
    RULES[rule.spec] = rule
    return rule


def rule_of(spec: opt.OptimizerSpec) -> OptimizerRule:
    """The rule of ``spec``'s exact class; ValueError naming it and the known ones."""
    rule = RULES.get(type(spec))
    if rule is None:
        raise ValueError(f"optimizer {type(spec).__name__} has no rule; known: "
                         f"{', '.join(cls.__name__ for cls in RULES)}")
    return rule


def apply_update(
    spec: opt.OptimizerSpec,
    rows: jnp.ndarray,
    slots: dict[str, jnp.ndarray],
    grad: jnp.ndarray,
    step: jnp.ndarray,
    row_dims: jnp.ndarray,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """New (rows, slots) for the touched rows. ``step`` counts updates from 1; ``row_dims`` is
    each row's logical dim (row-wise Adagrad averages g^2 over it, not over the padded dim)."""
    return rule_of(spec).update(spec, rows, slots, grad, step, row_dims)


def _lr(spec: opt.OptimizerSpec, step: int | None) -> list[float]:
    return [spec.learning_rate]


def _no_jte_eps(spec: opt.Adagrad) -> tuple[str, tuple[Any, ...]]:
    if spec.eps != 0.0:
        raise ValueError(f"the SparseCore Adagrad kernel has no epsilon; got eps={spec.eps}")
    return "AdagradOptimizerSpec", (spec.learning_rate, spec.initial_accumulator_value)


def sgd(spec: opt.SGD, rows, slots, grad, step, row_dims):
    return rows - jnp.float32(spec.learning_rate) * grad, {}


register(OptimizerRule(opt.SGD, sgd, _lr, in_step=True, tbe=lambda spec: ("EXACT_SGD", 0.0),
                       jte=lambda spec: ("SGDOptimizerSpec", (spec.learning_rate,))))


def adagrad(spec: opt.Adagrad, rows, slots, grad, step, row_dims):
    acc = slots["accumulator"] + grad * grad
    return rows - jnp.float32(spec.learning_rate) * grad / (jnp.sqrt(acc) + spec.eps), {"accumulator": acc}


def _lr_eps(spec: opt.Adagrad, step: int | None) -> list[float]:
    return [spec.learning_rate, spec.eps]


register(OptimizerRule(opt.Adagrad, adagrad, _lr_eps, in_step=True, tbe=lambda spec: ("EXACT_ADAGRAD", spec.eps),
                       jte=_no_jte_eps))


def rowwise_adagrad(spec: opt.RowWiseAdagrad, rows, slots, grad, step, row_dims):
    acc = slots["accumulator"] + jnp.sum(grad * grad, axis=1) / jnp.maximum(row_dims, 1)
    return rows - jnp.float32(spec.learning_rate) * grad / (jnp.sqrt(acc)[:, None] + spec.eps), {"accumulator": acc}


register(OptimizerRule(opt.RowWiseAdagrad, rowwise_adagrad, _lr_eps, in_step=True,
                       tbe=lambda spec: ("EXACT_ROWWISE_ADAGRAD", spec.eps), jte=None))


def adam(spec: opt.Adam, rows, slots, grad, step, row_dims):
    """torch.optim.Adam's arithmetic: 1 - beta and the bias corrections 1 - beta**t come from the
    double betas (``beta**t`` as ``expm1(t log beta)``, the log taken in double), never from betas
    rounded to float32 first (0.99999 -> 1 - beta 1.4e-3 off)."""
    lr = jnp.float32(spec.learning_rate)
    t = step.astype(jnp.float32)
    m, v = slots["momentum"], slots["velocity"]
    m = m + jnp.float32(1.0 - spec.beta_1) * (grad - m)
    v = v * jnp.float32(spec.beta_2) + jnp.float32(1.0 - spec.beta_2) * (grad * grad)
    correction_1 = -jnp.expm1(t * jnp.float32(math.log(spec.beta_1))) if spec.beta_1 else jnp.float32(1.0)
    correction_2 = -jnp.expm1(t * jnp.float32(math.log(spec.beta_2))) if spec.beta_2 else jnp.float32(1.0)
    denom = jnp.sqrt(v) / jnp.sqrt(correction_2) + jnp.float32(spec.epsilon)
    return rows - (lr / correction_1) * (m / denom), {"momentum": m, "velocity": v}


def _adam_hypers(spec: opt.Adam, step: int | None) -> list[float]:
    """(alpha_t, beta_1, beta_2, epsilon_t): the bias corrections of update ``step`` folded in."""
    if step is None:
        raise ValueError("Adam's bias corrections need the step number on the host; the ops backend "
                         "does not trace it into a step program")
    c1 = 1.0 - spec.beta_1 ** step
    c2 = math.sqrt(1.0 - spec.beta_2 ** step)
    return [spec.learning_rate * c2 / c1, spec.beta_1, spec.beta_2, spec.epsilon * c2]


register(OptimizerRule(opt.Adam, adam, _adam_hypers, in_step=False, tbe=None,
                       jte=lambda spec: ("AdamOptimizerSpec", (spec.learning_rate, spec.beta_1, spec.beta_2,
                                                               spec.epsilon))))


def ftrl(spec: opt.FTRL, rows, slots, grad, step, row_dims):
    lr = jnp.float32(spec.learning_rate)
    acc_old = slots["accumulator"]
    acc = acc_old + grad * grad
    k = -jnp.float32(spec.learning_rate_power)
    p_new = acc**k
    linear = slots["linear"] + grad - (p_new - acc_old**k) / lr * rows
    l1, l2 = jnp.float32(spec.l1_regularization_strength), jnp.float32(spec.l2_regularization_strength)
    numerator = -linear if spec.l1_regularization_strength == 0 else jnp.clip(linear, -l1, l1) - linear
    new_rows = numerator / ((p_new + spec.beta) / lr + 2.0 * l2)
    return new_rows, {"accumulator": acc, "linear": linear}


def _ftrl_hypers(spec: opt.FTRL, step: int | None) -> list[float]:
    return [spec.learning_rate, spec.learning_rate_power, spec.l1_regularization_strength,
            spec.l2_regularization_strength, spec.beta]


register(OptimizerRule(opt.FTRL, ftrl, _ftrl_hypers, in_step=True, tbe=None,
                       jte=lambda spec: ("FTRLOptimizerSpec", (
                           spec.learning_rate, spec.learning_rate_power, spec.l1_regularization_strength,
                           spec.l2_regularization_strength, spec.beta, spec.initial_accumulator_value,
                           spec.initial_linear_value))))

