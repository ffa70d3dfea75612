"""Input stages: JAX code fused into a :func:`~torch_tpu.compile.train_step` program around one of
its batch arguments.

A stage computes that argument inside the step program from state of its own (e.g. embedding
tables) and per-call inputs (e.g. the ids of the batch), and consumes the argument's gradient
there (e.g. a fused sparse optimizer update of the rows it read). The step program then runs
lookup, dense forward/backward/optimizer and the sparse update as ONE XLA program: no host
round trip of the argument or its gradient, one dispatch per step. The stage's state is donated
to the program and replaced by what ``backward`` returns.

Pass a :class:`StageInput` where the step expects the tensor, and name its position in
``input_grads`` (the stage needs the gradient).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.dtypes import to_torch_dtype


class InputStage(Protocol):
    """What a stage provides; ``state`` and the values it returns are pytrees of JAX arrays."""

    def state(self) -> Any:
        """The stage's current state (donated to the step program)."""

    def set_state(self, state: Any) -> None:
        """Take the state ``backward`` returned inside the step program."""

    def forward(self, state: Any, inputs: Any) -> jax.Array:
        """The batch argument's value (traced inside the step program)."""

    def backward(self, state: Any, inputs: Any, grad: jax.Array) -> Any:
        """The new state from the argument's gradient (traced inside the step program)."""


@dataclass(frozen=True, eq=False)
class StageInput:
    """A batch argument computed by ``stage`` from ``inputs`` inside the step program. ``key``
    identifies the shapes and dtypes of ``inputs`` (which compiled program serves the call)."""

    stage: InputStage
    inputs: Any
    key: Hashable

    def cache_key(self) -> tuple[int, Hashable]:
        return id(self.stage), self.key


def output_shape(value: StageInput) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and torch dtype of the argument ``value`` stands for (traced abstractly, no work)."""
    inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), value.inputs)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), value.stage.state())
    out = jax.eval_shape(value.stage.forward, state, inputs)
    return tuple(out.shape), to_torch_dtype(out.dtype)


def fused_program(stage: InputStage, program_fn: Any, position: int, grad_output: int,
                  donated: tuple[int, ...]) -> Any:
    """``program_fn`` (inputs -> outputs, the step's traced function) with ``stage`` around its
    input ``position``: ``fused(state, stage_inputs, *other_inputs) -> (outputs, new state)``,
    jitted with the state and the program's ``donated`` inputs (all before ``position``) donated;
    the stage's gradient is ``outputs[grad_output]``."""

    def fused(state: Any, stage_inputs: Any, *inputs: Any) -> tuple[Any, Any]:
        value = stage.forward(state, stage_inputs)
        outputs = program_fn(*inputs[:position], value, *inputs[position:])
        return outputs, stage.backward(state, stage_inputs, outputs[grad_output])

    return jax.jit(fused, donate_argnums=(0, *(2 + i for i in donated)))
