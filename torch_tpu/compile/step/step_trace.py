"""Trace one whole training step (forward, backward, optimizer update) into one functional FX graph.

The step is ``loss_fn`` under ``torch.autograd.grad`` followed by the optimizer's own ``step()``,
traced with ``make_fx`` on fake CPU tensors (core-ATen decompositions), then traced again under
functionalization so every in-place update (``param.add_``, ``exp_avg.mul_``, running stats)
becomes a plain value. The graph's inputs and outputs are flat tensor lists (see :class:`StepGraph`);
what it returns for each mutated input is the new value the caller stores back.

The optimizer runs its compile-friendly path while traced (``torch.compiler.is_compiling()`` is
True, ``capturable=True``, fused kernels replaced by the foreach implementation of the same math),
so step counters and bias corrections stay tensors inside the program: no host reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx
from torch import nn
from torch._decomp import core_aten_decompositions, decomposition_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

LossFn = Callable[..., torch.Tensor]

# graph nodes with side effects only (profiler ranges the optimizer opens)
_SIDE_EFFECT_ONLY = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


SyncGrads = Callable[[list[torch.Tensor | None]], list[torch.Tensor | None]]


class TensorSpec(NamedTuple):  # a NamedTuple: built and hashed for every input on every call
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @staticmethod
    def of(t: torch.Tensor, requires_grad: bool = False) -> TensorSpec:
        return TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype, requires_grad)


StateKey = tuple[int, str]  # (index of the parameter in the optimizer's flat list, state entry)


class StepSignature(NamedTuple):
    """Everything a traced step depends on besides tensor values (the program cache key).

    ``hyper`` holds each param group's non-tensor settings, ``static_state`` the non-tensor
    optimizer state entries."""

    params: tuple[TensorSpec, ...]  # the optimizer's parameters, group by group
    others: tuple[TensorSpec, ...]  # the model's other parameters and buffers
    state: tuple[tuple[StateKey, TensorSpec], ...]
    static_state: tuple[tuple[StateKey, Any], ...]
    group_tensors: tuple[tuple[tuple[int, str], TensorSpec], ...]  # tensor hyperparameters (lr ...)
    hyper: tuple[tuple[tuple[str, Any], ...], ...]
    batch_leaves: tuple[Any, ...]  # per leaf of the flattened batch: its TensorSpec, or the value
    batch_tree: Any  # the batch's pytree spec
    training: bool
    matmul_precision: str = "highest"  # torch_tpu.runtime.precision.current_name() when traced


@dataclasses.dataclass
class StepGraph:
    """A traced step. Inputs, in order: the optimizer's params, the model's other params/buffers,
    optimizer state tensors (``signature.state`` order), tensor hyperparameters, batch tensors
    (and, when ``needs_random_key``, key data). Outputs: the loss, the gradients of the batch
    inputs named by ``input_grads``, then one new value per entry of ``updates``."""

    graph: torch.fx.GraphModule
    signature: StepSignature
    # what each output after the loss and the input gradients is the new value of:
    # ("param", i) / ("other", i) / ("state", (param index, entry))
    updates: list[tuple[str, Any]]
    num_input_grads: int


def _fake(mode: FakeTensorMode, spec: TensorSpec) -> torch.Tensor:
    with mode:
        t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="cpu")
    return t.requires_grad_(spec.requires_grad) if spec.requires_grad else t


@contextlib.contextmanager
def _optimizer_swapped(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                       state: dict[int, dict[str, Any]], group_tensors: dict[tuple[int, str], torch.Tensor]
                       ) -> Iterator[dict[torch.Tensor, dict[str, Any]]]:
    """``optimizer`` stepping ``params`` (fakes) with ``state``, in its compile-friendly mode;
    restored afterwards. Yields the state mapping the step fills in."""
    saved_groups = [dict(g) for g in optimizer.param_groups]
    saved_state = optimizer.state
    new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    it = iter(range(len(params)))
    try:
        for gi, group in enumerate(optimizer.param_groups):
            group["params"] = [params[next(it)] for _ in saved_groups[gi]["params"]]
            for (g, key), value in group_tensors.items():
                if g == gi:
                    group[key] = value
            if group.get("fused"):
                group["fused"], group["foreach"] = False, True  # the same math, traceable
            elif group.get("foreach") is None and "foreach" in group:
                group["foreach"] = True  # fewer, larger ops in the graph
            if "capturable" in group:
                group["capturable"] = True
            if "differentiable" in group:
                group["differentiable"] = False
        for i, entries in state.items():
            new_state[params[i]] = dict(entries)
        optimizer.state = new_state
        with torch.compiler._compile_session_context():
            yield new_state
    finally:
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.clear()
            group.update(saved)
        optimizer.state = saved_state


def _model_output_loss(output: Any) -> torch.Tensor:
    """The loss a model returns itself: a scalar tensor, or the first element of a tuple (as
    TorchRec's ``DLRMTrain`` returns ``(loss, aux)``)."""
    loss = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "train_step without loss_fn needs a model returning a scalar loss (or (loss, ...)); got "
            f"{type(loss).__name__}{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    return loss


def trace_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn | None,
               param_names: Sequence[str], other_names: Sequence[str], signature: StepSignature,
               input_grads: Sequence[int], sync_grads: SyncGrads | None = None) -> StepGraph:
    """Trace ``signature``'s step; ``param_names``/``other_names`` name the model's tensors in
    input order (``param_names`` may contain None for optimizer params outside the model);
    ``sync_grads`` maps the trainable parameters' gradients to those the optimizer applies (e.g.
    averaged over ranks by collectives the program runs)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # constants made during the trace stay real
    batch_specs = [s for s in signature.batch_leaves if isinstance(s, TensorSpec)]
    flat_specs = [*signature.params, *signature.others, *(s for _, s in signature.state),
                  *(s for _, s in signature.group_tensors), *batch_specs]
    n_p, n_o, n_s, n_g = (len(signature.params), len(signature.others), len(signature.state),
                          len(signature.group_tensors))
    updates: list[tuple[str, Any]] = []

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        params = list(flat[:n_p])
        others = list(flat[n_p:n_p + n_o])
        state_in = flat[n_p + n_o:n_p + n_o + n_s]
        groups_in = flat[n_p + n_o + n_s:n_p + n_o + n_s + n_g]
        batch_tensors = iter(flat[n_p + n_o + n_s + n_g:])
        leaves = [next(batch_tensors) if isinstance(s, TensorSpec) else s for s in signature.batch_leaves]
        batch = torch.utils._pytree.tree_unflatten(leaves, signature.batch_tree)
        state: dict[int, dict[str, Any]] = defaultdict(dict)
        for ((i, key), _), value in zip(signature.state, state_in):
            state[i][key] = value
        for (i, key), value in signature.static_state:
            state[i][key] = value
        tensors = {name: t for name, t in zip(param_names, params) if name is not None}
        tensors.update(zip(other_names, others))
        with _reparametrize_module(model, tensors):
            output = model(*batch) if loss_fn is None else loss_fn(model, *batch)
        loss = _model_output_loss(output) if loss_fn is None else output
        wanted = [p for p in params if p.requires_grad] + [batch[i] for i in input_grads]
        grads = torch.autograd.grad(loss.reshape(()), wanted, allow_unused=True)
        trainable = [p for p in params if p.requires_grad]
        if sync_grads is not None:
            grads = (*sync_grads(list(grads[:len(trainable)])), *grads[len(trainable):])
        for p, g in zip(trainable, grads):
            p.grad = g
        with _optimizer_swapped(optimizer, params, state, dict(zip(
                (k for k, _ in signature.group_tensors), groups_in))) as after:
            optimizer.step()
        for p in trainable:
            p.grad = None
        input_gradients = [torch.zeros_like(batch[i]) if g is None else g
                           for i, g in zip(input_grads, grads[len(trainable):])]
        out = [loss.detach().reshape(()), *input_gradients]
        updates.clear()
        for i, p in enumerate(params):
            updates.append(("param", i))
            out.append(p)
        for i, t in enumerate(others):
            updates.append(("other", i))
            out.append(t)
        for i, p in enumerate(params):
            for key, value in sorted(after.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    updates.append(("state", (i, key)))
                    out.append(value)
        return out

    with torch.autograd.set_multithreading_enabled(False):
        mutating = make_fx(step, decomposition_table=_MUTATING_TRACE_DECOMPOSITIONS)(
            *[_fake(mode, s) for s in flat_specs])
        functional = make_fx(torch.func.functionalize(mutating, remove="mutations"),
                             decomposition_table=core_aten_decompositions())(
            *[_fake(mode, s._replace(requires_grad=False)) for s in flat_specs])
    _strip_side_effects(functional)
    return StepGraph(functional, signature, list(updates), len(input_grads))


# native_batch_norm updates running_mean/var without saying so in its schema, so functionalization
# would keep the stale stats: trace it as _native_batch_norm_legit (annotated), which functionalizes
# to _native_batch_norm_legit_functional returning the new stats.
_MUTATING_TRACE_DECOMPOSITIONS = {
    **core_aten_decompositions(),
    torch.ops.aten.native_batch_norm.default: decomposition_table[torch.ops.aten.native_batch_norm.default],
}


def _strip_side_effects(gm: torch.fx.GraphModule) -> None:
    """Drop the write-backs into graph inputs (their new values are outputs already) and the
    profiler ranges, then dead code."""
    for node in reversed(list(gm.graph.nodes)):  # a range's exit before its enter
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder":
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target in _SIDE_EFFECT_ONLY:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def unchanged_outputs(step: StepGraph) -> list[bool]:
    """Per entry of ``step.updates``: whether the graph returns the input itself (nothing to
    store back)."""
    output = next(n for n in step.graph.graph.nodes if n.op == "output")
    values = list(output.args[0])[1 + step.num_input_grads:]
    return [isinstance(v, torch.fx.Node) and v.op == "placeholder" for v in values]


