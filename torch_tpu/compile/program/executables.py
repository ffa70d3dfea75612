"""Whole programs as compiled XLA executables, stored serialized in the persistent cache.

A second process running a stored program (a ``train_step``, a ``torch.compile`` graph) would
otherwise lower the stored ``jax.export`` program to MLIR again only to find its executable in
JAX's cache, and lowering an exported program initialises JAX's CPU LAPACK handlers, which
imports SciPy: 175 ms of the main job's first step. Loading the serialized executable (level
``compiled``, written without pickle by :mod:`torch_tpu.compile.program.executable_codec`) skips all of it. A
compiled executable is also cheaper to call than ``jax.jit``'s dispatch, which checks and hashes
the arguments on every call.

An executable is specific to the backend, the devices and the input types it was compiled for:
its key adds them, and the process, to the program's key. SPMD programs over several processes'
devices (a multi-controller job: ``torch_tpu.compile.collectives.spmd``) are stored too, each process its own
executable: JAX's cache would not serve them (its key differs per process on XLA:CPU and only
process 0 writes), so every rank but the first compiled its program again on every run. Inputs of
other types than the first call's run through ``jax.jit``.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from collections.abc import Callable, Sequence
from typing import Any

import jaxlib

import torch_tpu.compile.program.executable_codec as executable_codec
import xla_cache
from torch_tpu.runtime import compiler_options, persistent_cache
from torch_tpu.runtime import device as tpu_device
from torch_tpu.runtime._jax import jax

_log = logging.getLogger(__name__)


def _note_last(outputs: Any) -> None:
    """A program's last output is what ``torch.tpu.synchronize()`` waits for next (programs run in order)."""
    leaves = jax.tree_util.tree_leaves(outputs)
    if leaves:
        tpu_device.note_output(leaves[-1])


class CompiledProgram:
    """``jax.jit(fn, donate_argnums=donated)``, compiled for the first call's inputs and called as
    that executable from then on; with a ``key`` (the program's persistent-cache key) the
    executable is loaded from, or stored into, the cache."""

    def __init__(self, fn: Callable[..., Any], donated: Sequence[int] = (), key: str | None = None) -> None:
        self.jitted = jax.jit(fn, donate_argnums=tuple(donated))
        self._key = key
        self._compiled: dict[tuple, Any] = {}  # by the compiler options in force (runtime.compiler_options)

    def __call__(self, *inputs: Any) -> Any:
        options = compiler_options.key()
        compiled = self._compiled.get(options)
        if compiled is None:
            compiled = self._compiled[options] = self._compile(inputs, options)
        try:
            outputs = compiled(*inputs)
        except (TypeError, ValueError):  # other shapes, dtypes or placements than the first call's
            outputs = self.jitted(*inputs)
        _note_last(outputs)
        return outputs

    def lowered_text(self, *inputs: Any) -> str:
        """The program for ``inputs`` as StableHLO text."""
        return self.jitted.lower(*inputs).as_text()

    def _compile(self, inputs: Sequence[Any], options: tuple) -> Any:
        options = compiler_options.with_platform_defaults(options, jax.local_devices()[0].platform)
        jax_options = compiler_options.for_jax(options)
        if self._key is None or not _storable(inputs):
            with persistent_cache.persistent():
                return self.jitted.lower(*inputs).compile(compiler_options=jax_options)
        key = executable_key(self._key + (f"|options={options}" if options else ""), inputs)
        loaded = xla_cache.load(persistent_cache.COMPILED_LEVEL, key, executable_codec.decode)
        if loaded is not None:
            xla_cache.xla_counts["hits"] += 1
            return loaded
        with xla_cache.jax_cache_bypassed():  # compiled here, not loaded from JAX's cache: it serializes whole
            compiled = self.jitted.lower(*inputs).compile(compiler_options=jax_options)
        xla_cache.xla_counts["misses"] += 1
        _store(key, compiled)
        return compiled


def executable_key(program_key: str, inputs: Sequence[Any]) -> str:
    """The cache key of ``program_key``'s executable for ``inputs`` on this backend, in this
    process (several share a cache: each runs on its own devices)."""
    device = jax.local_devices()[0]  # where uncommitted inputs go
    h = hashlib.sha256(program_key.encode())
    h.update(f"|{jax.__version__}|{jaxlib.__version__}|{platform.machine()}|{device.client.platform}|"
             f"{device.client.platform_version}|{device.device_kind}|{jax.config.jax_default_device}|"
             f"{jax.process_index()}|{device.id}".encode())
    for x in inputs:
        aval = jax.typeof(x)
        sharding = x.sharding if isinstance(x, jax.Array) and x.committed else None
        devices = [d.id for d in sharding._device_assignment] if sharding is not None else None
        h.update(f"|{aval.str_short()}:{aval.weak_type}:{sharding}:{devices}".encode())
    return h.hexdigest()


def _storable(inputs: Sequence[Any]) -> bool:
    """Whether the program for ``inputs`` is stored here: the cache is on and the backend
    serializes executables (else JAX's cache keeps it)."""
    client = jax.local_devices()[0].client
    return xla_cache.cache_dir() is not None and getattr(client, "supports_executable_serialization", True)


def _store(key: str, compiled: Any) -> None:
    blob = executable_codec.encode(compiled)
    if blob is None:  # a program the plain encoding does not describe: JAX's cache keeps it
        _log.info("the compiled program %s is not stored (not a plain program of one device or mesh)", key[:16])
        return
    xla_cache.store(persistent_cache.COMPILED_LEVEL, key, blob)
