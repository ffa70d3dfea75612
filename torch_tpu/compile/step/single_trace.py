"""``torch.tpu.optimizers.SingleTraceTrainer``: TorchTPU's whole training step (forward, loss,
backward, optimizer update) as one compiled program, built on :func:`train_step`.

The functional optimizer (``torch.tpu.optimizers``: :mod:`.functional_optimizers`) runs inside
the step through :class:`FunctionalAdapter`, a ``torch.optim.Optimizer`` whose ``step()`` applies
the optimizer's per-tensor rule to each parameter and its state; ``train_step`` traces it with the
model into one functional graph, compiles it to one XLA program per batch signature, and keeps the
model's parameters and the optimizer state on the device between calls.

As TorchTPU's, a step needs ``compile_fn`` (given to the trainer or to
``make_compiled_train_step``; ValueError otherwise), and ``param_group`` keys parameters by their
names with dots as underscores (``"0_weight"``; ``params`` by the model's own names).

Differences from TorchTPU: the program is built by ``train_step``, so ``compile_fn`` (TorchTPU's
callback compiling its traced FX graph, e.g. ``torch.compile``) is required and not called; the
model must be on the tpu device (``train_step``'s rule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from torch_tpu.compile.step.functional_optimizers import SLOTS, Optimizer, ParamGroup
from torch_tpu.compile.step.step_program import TrainStep, train_step


class _GradsOnly(Optimizer):
    """No optimizer: the step keeps each parameter's gradient (TorchTPU's trainer without one)."""

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"m": torch.zeros_like(param)}

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        state["m"].copy_(grad)


class FunctionalAdapter(torch.optim.Optimizer):
    """A functional optimizer as the ``torch.optim.Optimizer`` ``train_step`` traces: per
    parameter, its state entries (``m``, ``v``, ``step``) and its update rule."""

    def __init__(self, params: list[torch.Tensor], functional: Optimizer) -> None:
        settings = ",".join(f"{k}={v!r}" for k, v in sorted(functional.defaults.items()))
        super().__init__(params, {"functional": f"{type(functional).__qualname__}({settings})"})
        self.functional = functional

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.functional.init_state(p))
                self.functional.update(p, p.grad, state)


def _model_loss(model: torch.nn.Module, inputs: Any, targets: Any,
                compute_loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """TorchTPU's loss: ``compute_loss_fn(model, args, kwargs)``, else the MSE to ``targets``, else
    the model output's ``loss`` (attribute or key), else the mean of its logits or first tensor."""
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else \
        (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {})
    if compute_loss_fn is not None:
        return compute_loss_fn(model, args, kwargs)
    out = model(*args, **kwargs)
    if targets is not None:
        return F.mse_loss(out, targets)
    for name in ("loss", "logits", "sample"):
        value = out.get(name) if isinstance(out, dict) else getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value if name == "loss" else value.mean()
    first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise TypeError(f"SingleTraceTrainer: cannot extract a loss from the model's output of type {type(out)}")
    return first.mean()


def _key(name: str) -> str:
    """TorchTPU's key of parameter ``name`` in ``param_group``."""
    return name.replace(".", "_")


class SingleTraceTrainer:
    """Compiled train steps of ``model`` with ``optimizer`` (a ``torch.tpu.optimizers`` optimizer;
    None: the step only computes gradients, left in ``param.grad``). ``compute_loss_fn(model,
    args, kwargs) -> loss`` replaces the built-in loss (module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, compile_fn: Callable[..., Any] | None = None,
                 compute_loss_fn: Callable[..., torch.Tensor] | None = None):
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(f"SingleTraceTrainer: optimizer must be a torch.tpu.optimizers optimizer (AdamW, Sgd, "
                            f"Muon), got {type(optimizer).__name__}")
        self._model = model
        self._optimizer = optimizer
        self._compile_fn = compile_fn
        self._compute_loss_fn = compute_loss_fn
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        self._adapter = FunctionalAdapter([params[n] for n in self._names],
                                          optimizer if optimizer is not None else _GradsOnly())
        self._step: TrainStep | None = None

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The trained parameters by their model names."""
        return dict(self._model.named_parameters())

    @property
    def param_group(self) -> Any:
        """The parameters and optimizer state the step updates, keyed by TorchTPU's names (dots as
        underscores): the optimizer's ``ParamGroup`` (a dict of parameters without an optimizer)."""
        params = dict(self._model.named_parameters())
        if self._optimizer is None:
            return {_key(n): params[n] for n in self._names}
        group = ParamGroup(params={_key(n): params[n] for n in self._names})
        for n in self._names:
            for key, value in self._adapter.state.get(params[n], {}).items():
                getattr(group, SLOTS[key])[_key(n)] = value
        return group

    def make_compiled_train_step(self, example_inputs: Any, example_targets: Any = None,
                                 compile_fn: Callable[..., Any] | None = None) -> Callable[..., torch.Tensor]:
        """``train_step(inputs, targets=None) -> loss``: one compiled program per batch signature
        (``example_inputs`` / ``example_targets`` fix whether targets are passed). ValueError when
        no ``compile_fn`` is given here or to the trainer, as TorchTPU's."""
        if compile_fn is None and self._compile_fn is None:
            raise ValueError("SingleTraceTrainer: a compilation callback (compile_fn) must be provided either to "
                             "SingleTraceTrainer or to make_compiled_train_step, as TorchTPU requires (e.g. "
                             "compile_fn=torch.compile; here the step is train_step's program)")
        with_targets = example_targets is not None
        compute_loss_fn = self._compute_loss_fn

        def loss_fn(model: torch.nn.Module, inputs: Any, *targets: Any) -> torch.Tensor:
            return _model_loss(model, inputs, targets[0] if targets else None, compute_loss_fn)

        if self._step is None:
            self._step = train_step(self._model, self._adapter, loss_fn)
        step = self._step

        def run(inputs: Any, targets: Any = None) -> torch.Tensor:
            if (targets is not None) != with_targets:
                raise ValueError("SingleTraceTrainer: pass targets to the step exactly when example_targets were given")
            loss = step(inputs, targets) if with_targets else step(inputs)
            if self._optimizer is None:
                for p in self._adapter.param_groups[0]["params"]:
                    p.grad = self._adapter.state[p]["m"]
            return loss

        return run
