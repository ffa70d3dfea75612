"""The device's random-number state: one JAX PRNG key, split once per random op.

Random lowerings are pure (they take a key); eager dispatch draws keys from here. Streams differ
from CPU torch's generator (as on CUDA), but are reproducible under ``torch.manual_seed``.

Both default seeds are fixed: the device's is 0, and :func:`fix_cpu_default_seed` gives CPU
torch's default generator PyTorch's classic default seed at registration, unless the process
already seeded it or drew from it. The pinned torch seeds that generator from hardware entropy at
startup, so a program that never seeds (TorchRec's MLPerf DLRM-v2 TPU script, whose DCN weights
are drawn on the CPU) trained differently on every run.
"""

from __future__ import annotations

import random as _py_random

import numpy as np
import torch

from torch_tpu.runtime._jax import jax

_state = {"seed": 0, "key": None}
CPU_DEFAULT_SEED = 67280421310721  # PyTorch's default seed of its CPU generator before 2.13


def fix_cpu_default_seed() -> bool:
    """Seed CPU torch's default generator with :data:`CPU_DEFAULT_SEED` where the process has
    neither seeded it (``torch.manual_seed`` / ``torch.seed``) nor drawn from it; whether it did."""
    generator = torch.default_generator
    fresh = torch._C.Generator().manual_seed(generator.initial_seed())
    if _seeded_by_caller() or not torch.equal(fresh.get_state(), generator.get_state()):
        return False
    generator.manual_seed(CPU_DEFAULT_SEED)
    return True


def _seeded_by_caller() -> bool:
    """Whether ``torch.manual_seed`` or ``torch.seed`` ran (each queues a CUDA seed call even
    without CUDA); True where torch keeps no such record, so nothing of the caller's is undone."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    return tracker is None or any(call is not None for call in tracker.get_calls())


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
