"""One record per SparseCore optimizer: its update, written once, and what every engine does with
it, looked up by spec type.

A :class:`OptimizerRule` says, for one :class:`~sparsecore.optimizers.OptimizerSpec` class (its
slots and hyperparameters are the class's own): its update of a batch's touched rows, in the
arguments of its TorchTPU op ``tpu::sparse_dense_matmul_grad_with_<name>`` (the slots and the
hyperparameters that op takes after the gradient); those hyperparameters for a spec and step, and
which of them change with the step; FBGEMM's fused TBE kernel and jax-tpu-embedding's optimizer
spec for it (None: no such kernel). Every engine that updates rows itself (the ``tpu::`` ops off
TPU and the ``xla`` backend) runs the rule's update through the core, ``sparsecore.entries.update``.
Each record is registered right below its update, as jax's
``lax`` keeps a rule beside its primitive: a new optimizer is its spec class plus one update and
record here.

The update formulas follow jax-tpu-embedding's SparseCore kernels; ``grad`` is the gradient of
each touched row already summed over all its occurrences in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from sparsecore import optimizers as opt

# (rows [n, dim], slots in the op's order, grad [n, dim], the op's hyperparameters, row_dims) ->
# (new rows, new slots). ``row_dims``: each row's logical dim ([n], or one number for all rows): row-wise
# statistics average over it, not over a padded dim. Hyperparameters are numbers or float32 scalars.
Update = Callable[[jnp.ndarray, tuple[jnp.ndarray, ...], jnp.ndarray, Sequence[Any], Any],
                  tuple[jnp.ndarray, tuple[jnp.ndarray, ...]]]


@dataclass(frozen=True)
class OptimizerRule:
    """Everything the engines do with one optimizer spec class (see the module docstring).

    ``update``: the rows' update (:data:`Update`). ``op_hypers(spec, step)``: the fused op's
    hyperparameters after its gradient, in its schema's order (``step``: the update's number from
    1; None where ``varies`` is empty: none depends on it); ``varies``: the positions of those
    that change with the step; ``tensors``: the positions the op takes as tensors (a step
    program's inputs; the others are numbers, constants of the program). ``tbe(spec)``:
    ``(EmbOptimType member, eps)`` of FBGEMM's kernel, or None where it has none. ``jte(spec)``:
    ``(class name in jax_tpu_embedding's embedding_spec, its arguments)``, or None where it has no
    such kernel (it raises for unsupported settings)."""

    spec: type[opt.OptimizerSpec]
    update: Update
    op_hypers: Callable[[Any, int | None], list[float]]
    varies: tuple[int, ...]
    tensors: tuple[int, ...]
    tbe: Callable[[Any], tuple[str, float]] | None
    jte: Callable[[Any], tuple[str, tuple[Any, ...]]] | None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def op_name(self) -> str:
        """The fused TorchTPU op (in ``torch.ops.tpu``)."""
        return f"sparse_dense_matmul_grad_with_{self.name}"

    @property
    def in_step(self) -> bool:
        """Its hyperparameters are fixed: a traced step program can run the update."""
        return not self.varies

    @property
    def program_inputs(self) -> tuple[int, ...]:
        """The hyperparameters an update program takes as inputs: the op's tensors and those that
        change with the step."""
        return tuple(sorted({*self.tensors, *self.varies}))


RULES: dict[type[opt.OptimizerSpec], OptimizerRule] = {}
_BY_NAME: dict[str, OptimizerRule] = {}


def register(rule: OptimizerRule) -> OptimizerRule:
    """Add ``rule`` (one per spec class)."""
    if rule.spec in RULES:
        raise ValueError(f"optimizer {rule.spec.__name__} already has a rule")
    RULES[rule.spec] = rule
    _BY_NAME[rule.name] = rule
    return rule


def unregister(spec: type[opt.OptimizerSpec]) -> None:
    """Remove the rule of ``spec`` (e.g. one a test registered)."""
    del _BY_NAME[RULES.pop(spec).name]


def rule_of(spec: opt.OptimizerSpec) -> OptimizerRule:
    """The rule of ``spec``'s exact class; ValueError naming it and the known ones."""
    rule = RULES.get(type(spec))
    if rule is None:
        raise ValueError(f"optimizer {type(spec).__name__} has no rule; known: "
                         f"{', '.join(cls.__name__ for cls in RULES)}")
    return rule


def rule_named(name: str) -> OptimizerRule:
    """The rule of the optimizer called ``name`` (its fused op's suffix)."""
    rule = _BY_NAME.get(name)
    if rule is None:
        raise ValueError(f"no optimizer named {name!r}; known: {', '.join(_BY_NAME)}")
    return rule


def _lr(spec: opt.OptimizerSpec, step: int | None) -> list[float]:
    return [spec.learning_rate]


def _no_jte_eps(spec: opt.Adagrad) -> tuple[str, tuple[Any, ...]]:
    if spec.eps != 0.0:
        raise ValueError(f"the SparseCore Adagrad kernel has no epsilon; got eps={spec.eps}")
    return "AdagradOptimizerSpec", (spec.learning_rate, spec.initial_accumulator_value)


def _per_row(row_dims: Any) -> Any:
    """``row_dims`` broadcast against [n, dim] values."""
    return row_dims if jnp.ndim(row_dims) == 0 else row_dims[:, None]


def sgd(rows, slots, grad, hypers, row_dims):
    (learning_rate,) = hypers
    return rows - learning_rate * grad, ()


register(OptimizerRule(opt.SGD, sgd, _lr, varies=(), tensors=(0,), tbe=lambda spec: ("EXACT_SGD", 0.0),
                       jte=lambda spec: ("SGDOptimizerSpec", (spec.learning_rate,))))


def adagrad(rows, slots, grad, hypers, row_dims):
    (accumulator,), (learning_rate, epsilon) = slots, hypers
    acc = accumulator + grad * grad
    return rows - learning_rate * grad / (jnp.sqrt(acc) + epsilon), (acc,)


def _lr_eps(spec: opt.Adagrad, step: int | None) -> list[float]:
    return [spec.learning_rate, spec.eps]


register(OptimizerRule(opt.Adagrad, adagrad, _lr_eps, varies=(), tensors=(0, 1),
                       tbe=lambda spec: ("EXACT_ADAGRAD", spec.eps),
                       jte=_no_jte_eps))


def rowwise_adagrad(rows, slots, grad, hypers, row_dims):
    """``accumulator`` [n]: acc += the mean over the row's logical dim of g^2."""
    (accumulator,), (learning_rate, epsilon) = slots, hypers
    acc = accumulator + jnp.sum(grad * grad, axis=1) / row_dims
    return rows - learning_rate * grad / (jnp.sqrt(acc)[:, None] + epsilon), (acc,)


register(OptimizerRule(opt.RowWiseAdagrad, rowwise_adagrad, _lr_eps, varies=(), tensors=(0, 1),
                       tbe=lambda spec: ("EXACT_ROWWISE_ADAGRAD", spec.eps), jte=None))


def adam(rows, slots, grad, hypers, row_dims):
    """jax-tpu-embedding's form: m += (1 - b1)(g - m); v += (1 - b2)(g^2 - v);
    w -= alpha_t m / (sqrt(v) + epsilon_t), the bias corrections folded into alpha_t and epsilon_t
    (:func:`_adam_hypers`). A ``velocity`` of one value per row [n] is row-wise (the mean over the
    row). 1 - b is taken in double, then rounded (as torch.optim.Adam's python-float betas are):
    ``beta_1`` and ``beta_2`` are numbers, never traced."""
    (momentum, velocity), (alpha_t, beta_1, beta_2, epsilon) = slots, hypers
    c1, c2 = jnp.float32(1.0 - float(beta_1)), jnp.float32(1.0 - float(beta_2))
    m = momentum + c1 * (grad - momentum)
    if velocity.ndim == 1:
        v_full = velocity[:, None] + c2 * (grad * grad - velocity[:, None])
        v = jnp.sum(v_full / _per_row(row_dims), axis=1)
        denom = jnp.sqrt(v)[:, None] + jnp.float32(epsilon)
    else:
        v = velocity + c2 * (grad * grad - velocity)
        denom = jnp.sqrt(v) + jnp.float32(epsilon)
    return rows - alpha_t * m / denom, (m, v)


def _adam_hypers(spec: opt.Adam, step: int | None) -> list[float]:
    """(alpha_t, beta_1, beta_2, epsilon_t): the bias corrections of update ``step`` folded in,
    computed in double."""
    if step is None:
        raise ValueError("Adam's bias corrections need the step number on the host; the ops backend "
                         "does not trace it into a step program")
    c1 = 1.0 - spec.beta_1 ** step
    c2 = math.sqrt(1.0 - spec.beta_2 ** step)
    return [spec.learning_rate * c2 / c1, spec.beta_1, spec.beta_2, spec.epsilon * c2]


register(OptimizerRule(opt.Adam, adam, _adam_hypers, varies=(0, 3), tensors=(0,), tbe=None,
                       jte=lambda spec: ("AdamOptimizerSpec", (spec.learning_rate, spec.beta_1, spec.beta_2,
                                                               spec.epsilon))))


def ftrl(rows, slots, grad, hypers, row_dims):
    """FTRL-proximal (``sparsecore.optimizers.FTRL``)."""
    (accumulator, linear), (learning_rate, learning_rate_power, l1, l2, beta) = slots, hypers
    k = -jnp.float32(learning_rate_power)
    acc = accumulator + grad * grad
    p_new = acc**k
    lin = linear + grad - (p_new - accumulator**k) / learning_rate * rows
    l1, l2 = jnp.float32(l1), jnp.float32(l2)
    numerator = jnp.clip(lin, -l1, l1) - lin
    new = numerator / ((p_new + jnp.float32(beta)) / learning_rate + 2.0 * l2)
    return new, (acc, lin)


def _ftrl_hypers(spec: opt.FTRL, step: int | None) -> list[float]:
    return [spec.learning_rate, spec.learning_rate_power, spec.l1_regularization_strength,
            spec.l2_regularization_strength, spec.beta]


register(OptimizerRule(opt.FTRL, ftrl, _ftrl_hypers, varies=(), tensors=(0,), tbe=None,
                       jte=lambda spec: ("FTRLOptimizerSpec", (
                           spec.learning_rate, spec.learning_rate_power, spec.l1_regularization_strength,
                           spec.l2_regularization_strength, spec.beta, spec.initial_accumulator_value,
                           spec.initial_linear_value))))
