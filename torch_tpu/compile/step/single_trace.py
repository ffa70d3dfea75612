"""``torch.tpu.optimizers.SingleTraceTrainer``: TorchTPU's whole training step (forward, loss,
backward, optimizer update) as one FX graph, compiled by the caller's ``compile_fn``.

As TorchTPU's: the step is a pure function of the flattened ``(param_group, buffers, inputs[,
targets])`` traced with ``make_fx`` (fake tensors); ``compile_fn`` (given to the trainer or to
``make_compiled_train_step``; ValueError without one) receives ``(graph_module, flat_inputs)``, or
``(graph_module)`` when it takes one positional argument, and what it returns runs each step.
``param_group`` keys parameters by their names with dots as underscores (``"0_weight"``),
``params`` by the model's own names. The functional optimizers update the parameters in place, so
the model sees each step's weights; buffers the model mutates are written back after each step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless
from torch.utils import _pytree as pytree

from torch_tpu.compile.step.functional_optimizers import Optimizer


def _loss(model: torch.nn.Module, state: dict[str, torch.Tensor], inputs: Any, targets: Any,
          compute_loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """TorchTPU's loss with ``state`` (parameters and buffers by model name) swapped into ``model``:
    ``compute_loss_fn(model, args, kwargs)``, else the MSE to ``targets``, else the output's
    ``loss`` (attribute or key), else the mean of its ``logits``/``sample``/first tensor."""
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else \
        (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {})
    with stateless._reparametrize_module(model, state, tie_weights=True):
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


def _compiled(compile_fn: Callable[..., Any], graph: torch.fx.GraphModule,
              flat_inputs: Sequence[Any]) -> Callable[..., Any]:
    """``compile_fn(graph, flat_inputs)``, or ``compile_fn(graph)`` when it takes exactly one
    positional argument (TorchTPU's rule; ``torch.compile`` is called with the graph alone)."""
    try:
        params = inspect.signature(compile_fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return compile_fn(graph, flat_inputs)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) == 1 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return compile_fn(graph)
    return compile_fn(graph, flat_inputs)


class SingleTraceTrainer:
    """Compiled train steps of ``model`` with ``optimizer`` (a ``torch.tpu.optimizers`` optimizer;
    None: the step only computes gradients, left in ``param.grad``). ``compile_fn`` is the default
    compilation callback of :meth:`make_compiled_train_step`; ``compute_loss_fn(model, args,
    kwargs) -> loss`` replaces the built-in loss (module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, compile_fn: Callable[..., Any] | None = None,
                 compute_loss_fn: Callable[..., torch.Tensor] | None = None):
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(f"SingleTraceTrainer: optimizer must be a torch.tpu.optimizers optimizer (AdamW, Sgd, "
                            f"Muon), got {type(optimizer).__name__}")
        self._model = model
        self._optimizer = optimizer
        self._compile_fn = compile_fn
        self._compute_loss_fn = compute_loss_fn
        if callable(getattr(model, "tie_weights", None)):  # Hugging Face models tie their heads, as TorchTPU's
            model.tie_weights()
        self._names: dict[str, str] = {}  # TorchTPU's key -> the model's name
        params: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            self._names[name.replace(".", "_")] = name
            params[name.replace(".", "_")] = p.detach()
        self._buffers: dict[str, torch.Tensor] = {}
        for name, b in model.named_buffers():
            self._names[name.replace(".", "_")] = name
            self._buffers[name.replace(".", "_")] = b.detach()
        self._param_group: Any = optimizer.init_param_group(params) if optimizer is not None else params

    @property
    def param_group(self) -> Any:
        """The parameters and optimizer state the step updates: the optimizer's ``ParamGroup`` (a
        dict of parameters without an optimizer), keyed as ``"0_weight"``."""
        return self._param_group

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The trained parameters by the model's names."""
        group = self._param_group.params if self._optimizer is not None else self._param_group
        return {self._names[k]: v for k, v in group.items()}

    def _by_model_name(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self._names[k]: v for k, v in tensors.items()}

    def make_compiled_train_step(self, example_inputs: Any, example_targets: Any = None,
                                 compile_fn: Callable[..., Any] | None = None) -> Callable[..., torch.Tensor]:
        """``train_step(inputs, targets=None) -> loss`` running what ``compile_fn`` made of the traced
        step (module docstring). ``example_inputs`` / ``example_targets`` fix the batch's structure
        and whether targets are passed. ValueError when no ``compile_fn`` is given here or to the
        trainer, as TorchTPU's."""
        compile_fn = compile_fn if compile_fn is not None else self._compile_fn
        if compile_fn is None:
            raise ValueError("SingleTraceTrainer: a compilation callback (compile_fn) must be provided either to "
                             "SingleTraceTrainer or to make_compiled_train_step (e.g. compile_fn=torch.compile)")
        with_targets = example_targets is not None
        flat_inputs, in_spec = pytree.tree_flatten(
            (self._param_group, self._buffers, example_inputs) + ((example_targets,) if with_targets else ()))
        out_spec: list[pytree.TreeSpec] = []

        def step(*flat: Any) -> tuple[Any, ...]:
            group, buffers, inputs, *targets = pytree.tree_unflatten(list(flat), in_spec)
            params = group.params if self._optimizer is not None else group

            def loss_of(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
                # the buffers are an argument, not captured: the model may update them in place (BatchNorm)
                state = {**self._by_model_name(p), **self._by_model_name(b)}
                return _loss(self._model, state, inputs, targets[0] if targets else None, self._compute_loss_fn), b

            grads, (loss, buffers) = torch.func.grad_and_value(loss_of, has_aux=True)(params, buffers)
            result = (loss, self._optimizer(group, grads) if self._optimizer is not None else grads, buffers)
            flat_out, spec = pytree.tree_flatten(result)
            out_spec[:] = [spec]
            return tuple(flat_out)

        graph = make_fx(step, tracing_mode="fake")(*flat_inputs)
        compiled = _compiled(compile_fn, graph, flat_inputs)

        def train_step(inputs: Any, targets: Any = None) -> torch.Tensor:
            if (targets is not None) != with_targets:
                raise ValueError("SingleTraceTrainer: pass targets to the step exactly when example_targets were "
                                 "given to make_compiled_train_step")
            flat, _ = pytree.tree_flatten(
                (self._param_group, self._buffers, inputs) + ((targets,) if with_targets else ()))
            loss, updated, buffers = pytree.tree_unflatten(list(compiled(*flat)), out_spec[0])
            self._buffers = buffers
            self._model.load_state_dict(self._by_model_name(buffers), strict=False)
            if self._optimizer is not None:
                self._param_group = updated
            else:
                named = dict(self._model.named_parameters())
                for key, grad in updated.items():
                    named[self._names[key]].grad = grad
            return loss

        return train_step
