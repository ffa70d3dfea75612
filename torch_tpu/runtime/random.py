"""The device's random-number state: one JAX PRNG key, split once per random op.

Random lowerings are pure (they take a key); eager dispatch draws keys from here. Streams differ
from CPU torch's generator (as on CUDA), but are reproducible under ``torch.manual_seed``.
"""

from __future__ import annotations

import random as _py_random

import numpy as np
import torch

from torch_tpu.runtime._jax import jax

_state = {"seed": 0, "key": None}


def manual_seed(seed: int) -> None:
    """Reset the device generator (``torch.manual_seed`` calls this too)."""
    seed = int(seed)
    _state["seed"] = seed
    _state["key"] = jax.random.key(seed & 0xFFFFFFFFFFFFFFFF)


def seed() -> None:
    manual_seed(_py_random.getrandbits(63))


def initial_seed() -> int:
    return _state["seed"]


def next_key() -> jax.Array:
    """A fresh key for one random op, advancing the generator."""
    key = _state["key"]
    if key is None:
        manual_seed(_state["seed"])
        key = _state["key"]
    key, sub = jax.random.split(key)
    _state["key"] = key
    return sub


def get_rng_state(device: object = None) -> torch.Tensor:
    if _state["key"] is None:
        manual_seed(_state["seed"])
    data = np.asarray(jax.random.key_data(_state["key"])).astype(np.uint32)
    return torch.from_numpy(data.view(np.uint8).copy())


def set_rng_state(state: torch.Tensor, device: object = None) -> None:
    data = state.cpu().numpy().astype(np.uint8).view(np.uint32)
    _state["key"] = jax.random.wrap_key_data(jax.numpy.asarray(data))


def get_rng_state_all() -> list[torch.Tensor]:
    """One state per device (``torch.cuda.get_rng_state_all``): this process drives one."""
    return [get_rng_state()]


def set_rng_state_all(states: list[torch.Tensor]) -> None:
    (state,) = states
    set_rng_state(state)
