"""``torch.tpu.optimizers``: TorchTPU's stateless functional optimizers (``AdamW``, ``Sgd``, ``Muon``).

An optimizer holds only its hyperparameters (fixed at construction, read through ``defaults``).
``init_param_group(params_or_module)`` returns a ``ParamGroup`` (the parameters and their
optimizer state: momenta, step counts) and ``step(group, grads)`` updates it in place and returns
it, the math of ``torch.optim``'s optimizers of the same names. Each is built from two per-tensor
rules, :meth:`Optimizer.init_state` and :meth:`Optimizer.update`; ``ParamGroup`` is a pytree, which
:class:`~torch_tpu.compile.step.single_trace.SingleTraceTrainer` flattens into its traced step.
"""

from __future__ import annotations

import abc
import dataclasses
import types
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch.optim import _muon
from torch.utils import _pytree as pytree

__all__ = ["AdamW", "Muon", "Optimizer", "Sgd"]


@dataclasses.dataclass
class ParamGroup:
    """Parameters by name and each one's optimizer state (``opt_state_m``, ``opt_state_v`` where
    the optimizer keeps it, ``opt_steps``: float32 step counts)."""

    params: dict[str, torch.Tensor]
    opt_state_m: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    opt_state_v: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    opt_steps: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


pytree.register_dataclass(ParamGroup)  # SingleTraceTrainer flattens it into the traced step's inputs

SLOTS = {"m": "opt_state_m", "v": "opt_state_v", "step": "opt_steps"}


class Optimizer(abc.ABC):
    """A stateless functional optimizer over a nested :class:`ParamGroup` (module docstring)."""

    ParamGroup: ClassVar[type] = ParamGroup
    _HYPERPARAMETER_NAMES: ClassVar[tuple[str, ...]] = ("lr", "weight_decay")

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0):
        self._check_range("lr", lr)
        self._check_range("weight_decay", weight_decay)
        self._lr = lr
        self._weight_decay = weight_decay

    def _check_range(self, name: str, value: float, below: float | None = None) -> None:
        """ValueError naming this optimizer's argument ``name`` unless ``0 <= value`` (``< below``), as
        torch.optim's constructors check theirs."""
        if not (0 <= value and (below is None or value < below)):
            limit = ">= 0" if below is None else f"in [0, {below})"
            raise ValueError(f"torch.tpu.optimizers.{type(self).__name__}: {name} must be {limit}, got {value}")

    @property
    def defaults(self) -> Mapping[str, Any]:
        """The hyperparameters (read-only)."""
        return types.MappingProxyType({name: getattr(self, f"_{name}") for name in self._HYPERPARAMETER_NAMES})

    @abc.abstractmethod
    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """A fresh state for ``param``: entries of ``m``, ``v``, ``step``."""

    @abc.abstractmethod
    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """One step of ``param`` and its ``state``, in place."""

    def init_param_group(self, params: dict[str, torch.Tensor] | torch.nn.Module) -> ParamGroup:
        """A fresh :class:`ParamGroup` for ``params`` (a module's named parameters, detached, keyed as
        TorchTPU keys them: dots as underscores, ``"0_weight"``)."""
        named = ({n.replace(".", "_"): p.detach() for n, p in params.named_parameters()}
                 if isinstance(params, torch.nn.Module)
                 else dict(params))
        group = ParamGroup(params=named)
        for name, p in named.items():
            for key, value in self.init_state(p).items():
                getattr(group, SLOTS[key])[name] = value
        return group

    def step(self, param_group: ParamGroup, grads: dict[str, torch.Tensor]) -> ParamGroup:
        """One step of every parameter with a gradient in ``grads``; returns ``param_group``, updated."""
        for name, param in param_group.params.items():
            grad = grads.get(name)
            if grad is None:
                continue
            state = {key: getattr(param_group, slot)[name] for key, slot in SLOTS.items()
                     if name in getattr(param_group, slot)}
            self.update(param, grad, state)
        return param_group

    def __call__(self, param_group: ParamGroup, grads: dict[str, torch.Tensor]) -> ParamGroup:
        return self.step(param_group, grads)


def _step_count(param: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=param.device)


def _scaled(grad: torch.Tensor, grad_scale: torch.Tensor | None, maximize: bool) -> torch.Tensor:
    grad = grad if grad_scale is None else grad / grad_scale
    return -grad if maximize else grad


def _unless_inf(found_inf: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` where the AMP scaler found an inf (``found_inf`` > 0)."""
    return new if found_inf is None else torch.where(found_inf > 0, old, new)


class AdamW(Optimizer):
    """``torch.optim.AdamW``'s update; the moments in bfloat16 when ``use_bfloat16_moments``
    (TorchTPU's default: half the state's memory). ``grad_scale`` / ``found_inf``: an AMP scaler's
    (grads divided by the scale; no step where an inf was found). ``foreach``, ``capturable``,
    ``differentiable`` and ``fused`` choose torch kernels: the math is the same either way."""

    _HYPERPARAMETER_NAMES = ("lr", "weight_decay", "beta1", "beta2", "eps", "use_bfloat16_moments", "amsgrad",
                             "maximize")

    def __init__(self, lr: float = 1e-3, weight_decay: float = 1e-2, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, use_bfloat16_moments: bool = True, amsgrad: bool = False, maximize: bool = False,
                 foreach: bool = False, capturable: bool = True, differentiable: bool = False, fused: bool = False,
                 grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None):
        super().__init__(lr, weight_decay)
        if amsgrad:
            raise NotImplementedError("torch.tpu.optimizers.AdamW: amsgrad=True is not supported")
        self._check_range("eps", eps)
        self._check_range("beta1", beta1, below=1)
        self._check_range("beta2", beta2, below=1)
        self._beta1, self._beta2, self._eps = beta1, beta2, eps
        self._use_bfloat16_moments, self._amsgrad, self._maximize = use_bfloat16_moments, amsgrad, maximize
        self._grad_scale, self._found_inf = grad_scale, found_inf

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = torch.bfloat16 if self._use_bfloat16_moments else param.dtype
        return {"m": torch.zeros_like(param, dtype=dtype), "v": torch.zeros_like(param, dtype=dtype),
                "step": _step_count(param)}

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        g = _scaled(grad, self._grad_scale, self._maximize).to(torch.float32)
        step = state["step"] + 1
        m = state["m"].float().lerp(g, 1 - self._beta1)
        v = state["v"].float() * self._beta2 + (1 - self._beta2) * g * g
        m_hat = m / (1 - self._beta1 ** step)
        v_hat = v / (1 - self._beta2 ** step)
        new = param.float() * (1 - self._lr * self._weight_decay) - self._lr * m_hat / (v_hat.sqrt() + self._eps)
        found = self._found_inf
        param.copy_(_unless_inf(found, new, param.float()))
        state["m"].copy_(_unless_inf(found, m, state["m"].float()))
        state["v"].copy_(_unless_inf(found, v, state["v"].float()))
        state["step"].copy_(_unless_inf(found, step, state["step"]))


class Sgd(Optimizer):
    """``torch.optim.SGD``'s update (momentum buffer set to the first gradient, then
    ``momentum * buf + (1 - dampening) * grad``; Nesterov; weight decay added to the gradient)."""

    _HYPERPARAMETER_NAMES = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, maximize: bool = False, foreach: bool = False, fused: bool = True,
                 grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                 has_sparse_grad: bool = False):
        super().__init__(lr, weight_decay)
        self._check_range("momentum", momentum)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("torch.tpu.optimizers.Sgd: Nesterov momentum requires a momentum and zero dampening")
        self._momentum, self._dampening, self._nesterov, self._maximize = momentum, dampening, nesterov, maximize
        self._grad_scale, self._found_inf = grad_scale, found_inf

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = {"step": _step_count(param)}
        if self._momentum:
            state["m"] = torch.zeros_like(param)
        return state

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        g = _scaled(grad, self._grad_scale, self._maximize)  # negated before the decay, as torch.optim.SGD
        if self._weight_decay:
            g = g + self._weight_decay * param
        found = self._found_inf
        if self._momentum:
            buf = torch.where(state["step"] == 0, g, state["m"] * self._momentum + (1 - self._dampening) * g)
            state["m"].copy_(_unless_inf(found, buf, state["m"]))
            g = g + self._momentum * buf if self._nesterov else buf
        param.copy_(_unless_inf(found, param - self._lr * g, param))
        state["step"].copy_(_unless_inf(found, state["step"] + 1, state["step"]))


class Muon(Optimizer):
    """``torch.optim.Muon``'s update for 2-D parameters: momentum (Nesterov by default), the update
    orthogonalized by ``ns_steps`` Newton-Schulz iterations, the learning rate scaled by the shape
    (``adjust_lr_fn``), decoupled weight decay. Other parameters raise (train them with AdamW)."""

    _HYPERPARAMETER_NAMES = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                             "adjust_lr_fn", "use_bfloat16_moments")

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C),
                 eps: float = _muon.EPS, ns_steps: int = _muon.DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None,
                 use_bfloat16_moments: bool = False, foreach: bool = False, has_complex: bool = False):
        super().__init__(lr, weight_decay)
        if ns_steps >= 100:
            raise ValueError(f"torch.tpu.optimizers.Muon: ns_steps must be below 100, got {ns_steps}")
        self._check_range("momentum", momentum)
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"torch.tpu.optimizers.Muon: adjust_lr_fn must be None, 'original' or "
                             f"'match_rms_adamw', got {adjust_lr_fn!r}")
        self._momentum, self._nesterov, self._ns_coefficients = momentum, nesterov, tuple(ns_coefficients)
        self._eps, self._ns_steps, self._adjust_lr_fn = eps, ns_steps, adjust_lr_fn
        self._use_bfloat16_moments = use_bfloat16_moments

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        if param.dim() != 2:
            raise ValueError(f"torch.tpu.optimizers.Muon: parameters must be 2-D matrices, got shape "
                             f"{tuple(param.shape)}")
        dtype = torch.bfloat16 if self._use_bfloat16_moments else param.dtype
        return {"m": torch.zeros_like(param, dtype=dtype), "step": _step_count(param)}

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        m = state["m"].to(grad.dtype).lerp(grad, 1 - self._momentum)
        direction = grad.lerp(m, self._momentum) if self._nesterov else m
        direction = _muon._zeropower_via_newtonschulz(direction, self._ns_coefficients, self._ns_steps,
                                                      self._eps).to(param.dtype)  # (computed in bfloat16)
        lr = _muon._adjust_lr(self._lr, self._adjust_lr_fn, param.shape)
        param.copy_(param * (1 - self._lr * self._weight_decay) - lr * direction)
        state["m"].copy_(m)
        state["step"].add_(1)

