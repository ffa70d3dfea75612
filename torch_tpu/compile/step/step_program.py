"""``train_step(model, optimizer, loss_fn)``: the whole training step as ONE XLA program.

Forward, backward and the optimizer update (any ``torch.optim`` optimizer that runs under
``torch.compile``: SGD, Adagrad, Adam, AdamW ..., foreach or fused) are traced together
(:mod:`torch_tpu.compile.step.step_trace`), lowered through the op registry and jitted with the
parameters', buffers' and optimizer state's buffers donated: XLA updates them in place
(input-output aliasing). A call dispatches that one program and returns at once: the loss is a
tpu tensor that is not read back (``loss.item()`` waits for it), and nothing inside the step
reads a value on the host. Afterwards the model's parameters/buffers and ``optimizer.state`` hold
the new values (same tensor objects; state created by the first step is added).

One program is built per signature of the call: batch shapes/dtypes, non-tensor batch leaves,
the optimizer's settings (``lr`` is a program input: schedules do not recompile; other changed
settings do) and the layout of its state. Lazily initialised optimizers (Adam, SGD with momentum) therefore
compile twice: the first step creates the state, later steps take it as input.

    step = torch_tpu.compile.train_step(model, optimizer, lambda m, x, y: F.mse_loss(m(x), y))
    for x, y in batches:
        loss = step(x, y)           # tpu tensor, not synchronized
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

import torch_tpu.compile.program.graph as compiled_graph
import torch_tpu.compile.step.step_cache as step_cache
from torch_tpu.compile.collectives.collectives import (
    check_same_program,
    collective_groups,
    on_every_rank,
    program_lines,
)
from torch_tpu.compile.collectives.spmd import SpmdProgram, collective_lowering, describe_inputs
from torch_tpu.compile.program.executables import CompiledProgram
from torch_tpu.compile.program.fx_to_jax import needs_random_key, to_jax_function
from torch_tpu.compile.step.step_trace import (
    LossFn,
    StepGraph,
    StepSignature,
    TensorSpec,
    trace_step,
    unchanged_outputs,
)
from torch_tpu.runtime import persistent_cache, precision
from torch_tpu.runtime import random as tpu_random
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.dtypes import to_jax_dtype, to_torch_dtype
from torch_tpu.runtime.tensor import TpuTensor, cpu_to_jax, from_jax, to_jax, write

_log = logging.getLogger(__name__)
# float settings passed to the program as values, not baked in: schedules change them every step
_LIFTED = frozenset({"lr"})
_SCALAR = TensorSpec((), (), torch.float32)
_runs = [0]  # step programs run in this process, every TrainStep's


def programs_run() -> int:
    """Step programs run in this process so far (all :class:`TrainStep` objects together)."""
    return _runs[0]


@dataclasses.dataclass
class TrainStepStats:
    """Counters of one :class:`TrainStep`."""

    compiles: int = 0  # programs traced and jitted (one per call signature)
    calls: int = 0  # steps run (one program execution each)


class _Program:
    """One jitted step program and how its outputs map back onto the model and optimizer:
    ``updates`` (what each output after the loss and the input gradients is the new value of) and
    ``unchanged`` (per update: the program returns the input itself)."""

    def __init__(self, signature: StepSignature, updates: list[tuple[str, Any]], num_input_grads: int,
                 unchanged: list[bool], random: bool, exported: Any, fn: Any = None,
                 group: dist.ProcessGroup | None = None, key: str | None = None) -> None:
        self.signature, self.updates, self.num_input_grads = signature, updates, num_input_grads
        self.unchanged, self.random, self.exported = unchanged, random, exported
        n_donated = len(signature.params) + len(signature.others) + len(signature.state)
        changed = {(kind, where) for (kind, where), same in zip(updates, unchanged) if not same}
        state_keys = [key for key, _ in signature.state]
        # donate what the step replaces: its old buffer is dead once the program ran
        self.donated = tuple(
            i for i in range(n_donated)
            if self._input_slot(i, len(signature.params), len(signature.others), state_keys) in changed
        )
        self.collectives: list[str] = []  # over a group: what its ranks agreed on (program_lines)
        # over a group: SPMD, every rank its own batch, the collectives inside; either way its
        # executable (each rank's own) stored with the program (under the program's ``key``)
        if group is not None:
            self.runner: CompiledProgram | SpmdProgram = SpmdProgram(fn, group, self.donated, exported, key)
        else:
            self.runner = CompiledProgram(exported.call if exported is not None else fn, self.donated,
                                          key if exported is not None else None)

    def run(self, inputs: list[jax.Array]) -> Sequence[jax.Array]:
        """The program's outputs for ``inputs``."""
        return self.runner(*inputs)

    @staticmethod
    def traced(graph: StepGraph, group: dist.ProcessGroup | None = None, key: str | None = None) -> _Program:
        """The program of a freshly traced step, exported (to be stored under ``key``) where JAX can
        serialize it; over ``group`` an SPMD program, checked to be the same on every rank."""
        random = needs_random_key(graph.graph)
        avals = _input_avals(graph.signature, random)
        parts = (graph.signature, list(graph.updates), graph.num_input_grads, unchanged_outputs(graph), random)
        if group is None:
            fn = to_jax_function(graph.graph)
            return _Program(*parts, _exported(lambda: compiled_graph.export(fn)(*avals)), fn, key=key)
        lines = program_lines(graph.graph, describe_inputs(avals))
        check_same_program(lines, "train step", collective_groups(graph.graph))
        program = _Program(*parts, None, to_jax_function(graph.graph, collective_lowering(group)), group)
        program.collectives = lines
        program.exported = _exported(lambda: program.runner.export(avals))
        if program.exported is not None:  # run as it is stored, so that its executable is stored too
            program.runner = SpmdProgram(None, group, program.donated, program.exported, key)
        return program

    @staticmethod
    def loaded(signature: StepSignature, key: str, exported: Any, meta: dict[str, Any],
               group: dist.ProcessGroup | None = None) -> _Program:
        """The program stored under ``key`` by :meth:`meta` with ``exported``; over ``group`` its
        ranks first agree that they all loaded the same program."""
        if group is not None:
            check_same_program(meta["collectives"], "train step", [group])
        updates = [(kind, tuple(where) if kind == "state" else where) for kind, where in meta["updates"]]
        program = _Program(signature, updates, meta["num_input_grads"], meta["unchanged"], meta["random"], exported,
                           group=group, key=key)
        program.collectives = meta["collectives"]
        return program

    def meta(self) -> dict[str, Any]:
        return {"updates": self.updates, "num_input_grads": self.num_input_grads, "unchanged": self.unchanged,
                "random": self.random, "collectives": self.collectives}

    @staticmethod
    def _input_slot(i: int, n_params: int, n_others: int, state_keys: list) -> tuple[str, Any]:
        if i < n_params:
            return ("param", i)
        if i < n_params + n_others:
            return ("other", i - n_params)
        return ("state", state_keys[i - n_params - n_others])

    def lowered_text(self, inputs: Sequence[jax.Array]) -> str:
        return self.runner.lowered_text(*inputs)


def _exported(export: Callable[[], Any]) -> Any:
    """``export()``: the program as a ``jax.export``; None where JAX cannot serialize it (e.g. a
    custom call without a stable ABI): it then runs unstored."""
    try:
        return export()
    except Exception as error:  # noqa: BLE001
        _log.info("train_step: the step program is not serializable (%s); it is not cached on disk", error)
        return None


def _input_avals(signature: StepSignature, random: bool) -> list[jax.ShapeDtypeStruct]:
    """The program's inputs as abstract values, in :class:`StepGraph` order."""
    specs = [*signature.params, *signature.others, *(s for _, s in signature.state),
             *(s for _, s in signature.group_tensors),
             *(s for s in signature.batch_leaves if isinstance(s, TensorSpec))]
    avals = [jax.ShapeDtypeStruct(s.shape, to_jax_dtype(s.dtype)) for s in specs]
    if random:
        avals.append(jax.ShapeDtypeStruct(compiled_graph.key_data_shape(), np.uint32))
    return avals


class _Call(NamedTuple):
    signature: StepSignature
    state_and_groups: list[torch.Tensor | float]  # input values after the model's tensors
    batch_tensors: list[torch.Tensor]  # every tensor leaf
    state_targets: dict[tuple[int, str], torch.Tensor]  # the state tensors the program replaces


class TrainStep:
    """A compiled training step; call it with a batch (see :func:`train_step`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn | None,
                 input_grads: Sequence[int], group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.input_grads = tuple(input_grads)
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.stats = TrainStepStats()
        self._programs: dict[StepSignature, _Program] = {}
        self._replay: _Replay | None = None
        self._bind_tensors()

    def _bind_tensors(self) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("train_step: a parameter appears twice in the optimizer's param groups")
        names = {id(p): n for n, p in self.model.named_parameters()}
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise ValueError(
                f"train_step: optimizer parameter(s) {missing} (shapes "
                f"{[list(params[i].shape) for i in missing]}) are not parameters of the model")
        self._params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._param_names = [names[id(p)] for p in params]
        in_optimizer = {id(p) for p in params}
        self._others = [(n, t) for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                        if id(t) not in in_optimizer]
        for name, t in [*zip(self._param_names, params), *self._others]:
            if type(t) is not TpuTensor:
                if t.device.type == "tpu":
                    raise ValueError(f"train_step: model tensor {name!r} is a {type(t).__name__}; the step "
                                     "takes plain tpu tensors (not FSDP2/DTensor-sharded parameters)")
                raise ValueError(f"train_step: model tensor {name!r} is on {t.device}, not tpu "
                                 "(move the model with .to('tpu') before building the step)")

    # -- signature -------------------------------------------------------------------------------

    def _signature(self, batch: tuple[Any, ...]) -> _Call:
        """The call's signature and tensors."""
        for i in self.input_grads:
            if i >= len(batch) or not isinstance(batch[i], torch.Tensor):
                raise ValueError(f"train_step: input_grads names batch argument {i}, which is "
                                 f"{'missing' if i >= len(batch) else type(batch[i]).__name__}, not a tensor")
        index = self._index
        state, static_state, state_tensors, targets = [], [], [], {}
        for p, entries in self.optimizer.state.items():
            i = index.get(id(p))
            if i is None:
                continue
            for key in sorted(entries):
                value = entries[key]
                where = (i, key)
                if isinstance(value, torch.Tensor):
                    state.append((where, TensorSpec.of(value)))
                    state_tensors.append(value)
                    targets[where] = value
                else:
                    static_state.append((where, value))
        group_tensors, hyper, group_values = [], [], []
        for gi, group in enumerate(self.optimizer.param_groups):
            settings = []
            for key in sorted(k for k in group if k != "params"):
                value = group[key]
                if isinstance(value, torch.Tensor):
                    group_tensors.append(((gi, key), TensorSpec.of(value)))
                    group_values.append(value)
                elif key in _LIFTED and isinstance(value, float):
                    group_tensors.append(((gi, key), _SCALAR))
                    group_values.append(value)
                else:
                    settings.append((key, value if _hashable(value) else repr(value)))
            hyper.append(tuple(settings))
        leaves, tree = pytree.tree_flatten(batch)
        grad_leaves = {id(batch[i]) for i in self.input_grads}
        batch_leaves, batch_tensors = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                batch_leaves.append(TensorSpec.of(leaf, requires_grad=id(leaf) in grad_leaves))
                batch_tensors.append(leaf)
            else:
                batch_leaves.append(leaf if _hashable(leaf) else repr(leaf))
        signature = StepSignature(
            params=tuple(TensorSpec.of(p, requires_grad=p.requires_grad) for p in self._params),
            others=tuple(TensorSpec.of(t) for _, t in self._others),
            state=tuple(state), static_state=tuple(static_state), group_tensors=tuple(group_tensors),
            hyper=tuple(hyper), batch_leaves=tuple(batch_leaves), batch_tree=tree,
            training=self.model.training, matmul_precision=precision.current_name(),
        )
        return _Call(signature, state_tensors + group_values, batch_tensors, targets)

    def _program(self, signature: StepSignature) -> _Program:
        program = self._programs.get(signature)
        if program is None:
            if self._programs:
                _log.info("train_step: compiling step program %d (new batch shapes, optimizer "
                          "settings or state layout)", len(self._programs) + 1)
            other_names = [n for n, _ in self._others]
            key = step_cache.step_key(self.model, self.optimizer, self.loss_fn, self._param_names, other_names,
                                      signature, self.input_grads, self.group)
            stored = step_cache.load(key) if key is not None else None
            if self.group is not None and not on_every_rank(stored is not None, self.group):
                stored = None  # every rank traces (and agrees) if one has no stored program
            if stored is not None:
                program = _Program.loaded(signature, key, *stored, self.group)
            else:
                graph = trace_step(self.model, self.optimizer, self.loss_fn, self._param_names, other_names,
                                   signature, self.input_grads, None if self.group is None else self._averaged)
                program = _Program.traced(graph, self.group, key)
                if key is not None and program.exported is not None:
                    step_cache.store(key, program.exported, program.meta())
                    persistent_cache.counters.step_misses += 1
            self._programs[signature] = program
            self.stats.compiles += 1
        return program

    def _averaged(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``grads`` averaged over the ranks of the step's group, as DDP does (traced: in the
        program), as one all-reduce per dtype (as DDP's buckets: each collective costs a round trip)."""
        import torch.distributed._functional_collectives as fc

        out = list(grads)
        for dtype in dict.fromkeys(g.dtype for g in grads if g is not None):
            which = [i for i, g in enumerate(grads) if g is not None and g.dtype == dtype]
            flat = fc.all_reduce(torch.cat([grads[i].reshape(-1) for i in which]), "avg", self.group)
            for i, piece in zip(which, flat.split([grads[i].numel() for i in which])):
                out[i] = piece.view(grads[i].shape)
        return out

    # -- running ---------------------------------------------------------------------------------

    def _inputs(self, state_and_groups: list[torch.Tensor | float],
                batch_tensors: list[torch.Tensor]) -> list[jax.Array]:
        model_tensors = [*self._params, *(t for _, t in self._others)]
        arrays = [to_jax(t) for t in model_tensors]
        arrays += [_device_array(t) for t in state_and_groups]
        return [_committed(a) for a in arrays] + [_batch_array(t) for t in batch_tensors]

    def __call__(self, *batch: Any) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        precision.sync()
        outputs = self._replay.run(self, batch) if self._replay is not None else None
        if outputs is None:  # first call, or something changed since the last one
            # the last replay holds the arrays about to be donated: with it alive, each donated
            # input (the embedding tables) would be copied first
            self._replay = None
            call = self._signature(batch)
            program = self._program(call.signature)
            inputs = self._inputs(call.state_and_groups, call.batch_tensors)
            _check_distinct(inputs, program.donated)
            _copy_shared(inputs, program.donated, owners=1)
            if program.random:
                inputs.append(jax.random.key_data(tpu_random.next_key()))
            with persistent_cache.persistent():
                outputs = program.run(inputs)
            self._store(program, outputs, call.state_targets)
            self._replay = _Replay.after(self, program, call, batch, inputs)
        self.stats.calls += 1
        _runs[0] += 1
        loss = from_jax(outputs[0])
        if not self.input_grads:
            return loss
        return loss, tuple(from_jax(g) for g in outputs[1:1 + len(self.input_grads)])

    def _store(self, program: _Program, outputs: Sequence[jax.Array],
               state_targets: dict[tuple[int, str], torch.Tensor]) -> None:
        new_values = outputs[1 + program.num_input_grads:]
        for (kind, where), value, same in zip(program.updates, new_values, program.unchanged):
            if same:
                continue
            if kind == "param":
                _rebind(self._params[where], value)
            elif kind == "other":
                _rebind(self._others[where][1], value)
            else:
                old = state_targets.get(where)
                if type(old) is TpuTensor and old.shape == value.shape and old.dtype == to_torch_dtype(value.dtype):
                    _rebind(old, value)
                else:  # new state (the first step), or a CPU tensor (state loaded from a checkpoint)
                    i, key = where
                    self.optimizer.state[self._params[i]][key] = from_jax(value)

    def hlo_text(self, *batch: Any) -> str:
        """The lowered (StableHLO) text of the program ``batch`` runs, with its input-output
        aliasing (``tf.aliasing_output``) showing the donated buffers."""
        call = self._signature(batch)
        program = self._program(call.signature)
        inputs = self._inputs(call.state_and_groups, call.batch_tensors)
        if program.random:
            inputs.append(jax.random.key_data(tpu_random.next_key()))
        return program.lowered_text(inputs)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn | None = None, *,
               input_grads: Sequence[int] = (), group: dist.ProcessGroup | None = None) -> TrainStep:
    """Compile ``model``'s training step with ``optimizer`` into one XLA program per batch signature.

    ``loss_fn(model, *batch) -> scalar loss``; None: ``model(*batch)`` returns the loss (or
    ``(loss, ...)``, as TorchRec's ``DLRMTrain``). ``step(*batch)`` runs forward, backward and
    ``optimizer.step()`` and returns the loss as a tpu tensor without waiting for it. With
    ``input_grads`` (positions of tensor arguments in ``batch``) it returns
    ``(loss, gradients of those arguments)``, for a caller that continues backward outside the
    step (e.g. into embedding tables; or a model whose autograd functions update its buffers in
    backward, such as a fused embedding update, reached through such an argument). The model
    must be on the tpu device; ``.grad`` of its parameters is not filled in.

    ``group`` (a ``tpu_dist`` process group of several ranks on the XLA transport): data parallel
    over its ranks, each stepping on its own batch with the same program (SPMD,
    :mod:`torch_tpu.compile.collectives.spmd`): the gradients are averaged over the ranks inside it (as DDP),
    and functional collectives the model calls (``torch.distributed._functional_collectives``,
    e.g. an embedding all-to-all) are XLA collectives in it. Every rank must call the step with
    batches of the same shapes; ranks whose programs differ fail with ``CollectiveMismatchError``
    when it is compiled."""
    return TrainStep(model, optimizer, loss_fn, input_grads, group)


class _Replay:
    """The last call, to run again without rebuilding its signature: valid while every model and
    state tensor still holds the array the program left in it (nothing else wrote it), the
    optimizer's state entries and settings are the same objects, and the batch has the same
    shapes and dtypes (a flat tuple of tensors). Every check is an identity or length test run by
    C loops (``map``), not a walk over shapes: a call costs a few microseconds besides the program."""

    def __init__(self, program: _Program, tensors: list[TpuTensor], next_output: list[int | None],
                 fixed: list[jax.Array], batch_key: tuple, state: dict, entry_params: list[torch.Tensor],
                 groups: list[dict], training: bool) -> None:
        self.program, self.tensors, self.fixed, self.batch_key = program, tensors, fixed, batch_key
        self.training = training
        self.matmul_precision = precision.current_name()
        self.arrays = list(map(_box_array, tensors))
        self.rebinds = [(i, j) for i, j in enumerate(next_output) if j is not None]
        self.boxes = [t.storage_box for t in tensors]
        # what the optimizer held: its state dict's entries (load_state_dict replaces them), their
        # values (an eager step() may assign new tensors), the param groups and their settings
        self.state, self.num_states = state, len(state)
        self.entry_params = entry_params  # the step's parameters with state
        self.entries = [state[p] for p in self.entry_params]
        self.groups = list(groups)
        dicts = [*self.entries, *self.groups]
        self.lengths = list(map(len, dicts))
        self.item_dicts = [d for d in dicts for _ in d]
        self.item_keys = [k for d in dicts for k in d]
        self.item_values = [d[k] for d in dicts for k in d]

    @staticmethod
    def after(step: TrainStep, program: _Program, call: _Call, batch: tuple[Any, ...],
              inputs: list[jax.Array]) -> _Replay | None:
        """The replay of a call just run, or None when it cannot be replayed."""
        batch_key = _batch_key(batch)
        signature = call.signature
        state_keys = [where for where, _ in signature.state]
        updated = {u: 1 + program.num_input_grads + k
                   for k, (u, same) in enumerate(zip(program.updates, program.unchanged)) if not same}
        tensor_settings = any(isinstance(v, torch.Tensor) for g in step.optimizer.param_groups
                              for k, v in g.items() if k != "params")
        if (batch_key is None or program.random or tensor_settings
                or {w for kind, w in updated if kind == "state"} - set(state_keys)):
            return None  # the step created state (the first one), a pytree batch, random ops, or
            # tensor settings (an in-place change of one would not be seen)
        state = step.optimizer.state
        tensors = [*step._params, *(t for _, t in step._others),
                   *(state[step._params[i]][key] for i, key in state_keys)]
        slots = [*(("param", i) for i in range(len(step._params))),
                 *(("other", i) for i in range(len(step._others))), *(("state", w) for w in state_keys)]
        if not all(type(t) is TpuTensor and t.whole_storage and t.storage_box.array.shape == t.shape for t in tensors):
            return None
        fixed = inputs[len(tensors):len(inputs) - len(call.batch_tensors)]  # tensor settings (lr) as passed
        entry_params = [p for p in state if id(p) in step._index]
        return _Replay(program, tensors, [updated.get(s) for s in slots], fixed, batch_key, state, entry_params,
                       step.optimizer.param_groups, step.model.training)

    def _valid(self, step: TrainStep, batch: tuple[Any, ...]) -> bool:
        optimizer = step.optimizer
        state, groups = optimizer.state, optimizer.param_groups
        return (_batch_key(batch) == self.batch_key and step.model.training == self.training
                and precision.current_name() == self.matmul_precision
                and state is self.state and len(state) == self.num_states and len(groups) == len(self.groups)
                and all(map(operator.is_, map(_box_array, self.tensors), self.arrays))
                and all(map(operator.is_, map(_box, self.tensors), self.boxes))
                and all(map(operator.is_, map(state.get, self.entry_params), self.entries))
                and all(map(operator.is_, groups, self.groups))
                and list(map(len, self.entries)) + list(map(len, self.groups)) == self.lengths
                and all(map(operator.is_, map(dict.get, self.item_dicts, self.item_keys), self.item_values)))

    def run(self, step: TrainStep, batch: tuple[Any, ...]) -> Sequence[jax.Array] | None:
        """The program's outputs, stored into the model and optimizer; None when not valid."""
        if not self._valid(step, batch):
            return None
        inputs = [*self.arrays, *self.fixed, *map(_batch_array, batch)]
        _copy_shared(inputs, self.program.donated, owners=2)  # the storage box and self.arrays
        outputs = self.program.run(inputs)  # compiled by the call this replays: no cache context
        arrays, boxes = self.arrays, self.boxes
        for i, j in self.rebinds:
            boxes[i].array = arrays[i] = outputs[j]
        return outputs


_box = operator.attrgetter("storage_box")
_box_array = operator.attrgetter("storage_box.array")


def _batch_key(batch: tuple[Any, ...]) -> tuple | None:
    """Shapes and dtypes of a batch of tensors (None: other leaves, not replayed)."""
    if not all(isinstance(t, torch.Tensor) for t in batch):
        return None
    return tuple((type(t), t.shape, t.dtype, t.requires_grad) for t in batch)


def _rebind(t: TpuTensor, value: jax.Array) -> None:
    """Make ``t`` hold ``value`` (a program output of its shape and dtype)."""
    box = t.storage_box
    if t.whole_storage and box.array.shape == value.shape:
        box.array = value  # the common case, without write()'s size checks
    else:
        write(t, value)


def _committed(a: jax.Array) -> jax.Array:
    """``a`` committed to its device: eager results are uncommitted, program outputs committed,
    and jit compiles once per mix."""
    return a if a.committed else jax.device_put(a, a.sharding)


def _device_array(t: torch.Tensor | float) -> jax.Array:
    if type(t) is TpuTensor:
        return to_jax(t)
    if isinstance(t, float):
        return _scalar_array(t)
    if t.numel() <= _HOST_PUT_ELEMENTS and t.dtype in _NUMPY_DTYPES and not t.is_quantized:
        # a CPU optimizer state's step count: put from the host; a device copy would compile a
        # program per shape, too quick to compile for any cache to keep, so every run compiled it
        return jax.device_put(t.detach().resolve_conj().resolve_neg().numpy().copy(), jax.local_devices()[0])
    return cpu_to_jax(t)


_HOST_PUT_ELEMENTS = 64
# dtypes a CPU tensor's numpy view has (bfloat16 and the float8 formats have none)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})


def _batch_array(t: torch.Tensor | float) -> jax.Array | np.ndarray:
    """A batch argument as the program takes it: a CPU tensor as a private numpy copy, which the
    jitted call transfers itself (a few microseconds; an eager device copy per tensor costs
    hundreds), other dtypes and tpu tensors as committed device arrays."""
    if type(t) is torch.Tensor and t.dtype in _NUMPY_DTYPES and not t.is_quantized:
        return t.detach().resolve_conj().resolve_neg().contiguous().clone().numpy()
    return _committed(_device_array(t))


@functools.lru_cache(maxsize=256)
def _scalar_array(value: float) -> jax.Array:
    """A lifted setting (``lr``) as a committed float32 device scalar, made once per value (a
    host value put on the device: no program compiled, as committing a device value would)."""
    return jax.device_put(np.float32(value), jax.local_devices()[0])


def _copy_shared(inputs: list[jax.Array], donated: Sequence[int], owners: int) -> None:
    """Give the program a private copy of each donated input that something besides its
    ``owners`` known holders (the tensor's storage box ...) still references: a clone or deepcopy
    of a tpu tensor shares its JAX array, which donation would delete under it."""
    for i in donated:
        if sys.getrefcount(inputs[i]) > owners + 2:  # + this list's slot + getrefcount's argument
            inputs[i] = jax.device_put(inputs[i], inputs[i].sharding, may_alias=False)


def _check_distinct(inputs: Sequence[jax.Array], donated: Sequence[int]) -> None:
    seen: dict[int, int] = {}
    for i in donated:
        if id(inputs[i]) in seen:
            raise ValueError(f"train_step: step inputs {seen[id(inputs[i])]} and {i} share one buffer "
                             "(tied tensors outside the model's parameter list); give each its own storage")
        seen[id(inputs[i])] = i


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
