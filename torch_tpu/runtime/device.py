"""The ``torch.tpu`` device module and the PrivateUse1 backend registration.

One process drives one device (index 0), the default JAX backend's first device: XLA:CPU here,
a TPU chip when jax[tpu] and libtpu are installed — the same code path.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torch_tpu.runtime import generator as tpu_generator
from torch_tpu.runtime import host_heap, host_hooks
from torch_tpu.runtime import precision as tpu_precision
from torch_tpu.runtime import random as tpu_random
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.dtypes import FLOAT8_DTYPES
from tpu_facts import knobs

DEVICE_NAME = "tpu"
_registered = False
# The newest array produced by a dispatched op; synchronize() waits on it (ops run in order).
last_output: list[jax.Array | None] = [None]


def note_output(array: jax.Array) -> None:
    last_output[0] = array


def _jax_device() -> jax.Device:
    return jax.local_devices()[0]  # with jax.distributed, jax.devices() lists every process


def _check_index(device: int | str | torch.device | None) -> None:
    if device is None:
        return
    if isinstance(device, (str, torch.device)):
        device = torch.device(device)
        if device.type != DEVICE_NAME:
            raise ValueError(f"expected a tpu device, got {device}")
        device = 0 if device.index is None else device.index
    if device != 0:
        raise RuntimeError(
            f"tpu device index {device} is invalid: torch_tpu drives one device per process (index 0); "
            "run one process per chip"
        )


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _registered


def init() -> None:
    """Check that the device can be used here (as ``torch.cuda.init``): not in a process forked
    after the parent started the JAX backend."""
    if _in_bad_fork[0]:
        raise RuntimeError(
            "Cannot re-initialize tpu in forked subprocess. To use tpu with multiprocessing, "
            "you must use the 'spawn' start method"
        )


# True in a child forked after its parent started the JAX backend: the inherited runtime (its
# threads, the chip) is unusable there, so, as for CUDA, torch.manual_seed leaves the device alone.
_in_bad_fork = [False]


def _is_in_bad_fork() -> bool:
    return _in_bad_fork[0]


def _mark_fork_child() -> None:
    from jax._src import xla_bridge

    _in_bad_fork[0] = _in_bad_fork[0] or xla_bridge.backends_are_initialized()


os.register_at_fork(after_in_child=_mark_fork_child)


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device: int | str | torch.device) -> None:
    _check_index(device)


def synchronize(device: int | str | torch.device | None = None) -> None:
    """Wait until every op dispatched so far has finished on the device."""
    _check_index(device)
    _wait(last_output[0])


def _wait(array: jax.Array | None) -> None:
    if not _done(array):
        array.block_until_ready()  # type: ignore[union-attr]


def _done(array: jax.Array | None) -> bool:
    # a donated array was consumed by a later program, which noted its own output
    return array is None or array.is_deleted() or array.is_ready()


_torch_accelerator_synchronize = torch.accelerator.synchronize


def _accelerator_synchronize(device: int | str | torch.device | None = None) -> None:
    """``torch.accelerator.synchronize`` reaching :func:`synchronize` for the tpu device (PyTorch's
    C++ path asks the device guard, which a Python backend cannot implement for this call)."""
    kind = torch.device(device).type if isinstance(device, (str, torch.device)) else None
    if kind is None:
        current = torch.accelerator.current_accelerator()
        kind = current.type if current is not None else None
    if kind == DEVICE_NAME:
        synchronize(device if isinstance(device, (str, torch.device)) else None)
    else:
        _torch_accelerator_synchronize(device)


def get_device_name(device: int | str | torch.device | None = None) -> str:
    _check_index(device)
    d = _jax_device()
    return f"{d.platform.upper()} {d.device_kind}"


# Launchers and tests that know where a process' device sits better than the runtime does (XLA:CPU
# reports no torus coordinates) set these; torch.tpu.distributed.topology_aware_mesh reads them
# through get_local_device_attributes().
COORDS_ENV, CORE_ENV, SLICE_ENV = knobs.DEVICE_COORDS.name, knobs.CORE_ON_CHIP.name, knobs.SLICE_INDEX.name


def get_local_device_attributes() -> dict[str, Any]:
    """This process' device as TorchTPU reports it: ``id``, ``process_index``, ``device_kind``,
    ``platform``, and where the runtime knows them (TPU) ``coords`` (torus x, y, z),
    ``core_on_chip`` and ``slice_index``. ``TORCH_TPU_DEVICE_COORDS`` / ``TORCH_TPU_CORE_ON_CHIP`` /
    ``TORCH_TPU_SLICE_INDEX`` override the last three (set ``coords`` where the runtime has none)."""
    d = _jax_device()
    attrs: dict[str, Any] = {"id": d.id, "process_index": d.process_index, "device_kind": d.device_kind,
                             "platform": d.platform}
    for name in ("coords", "core_on_chip", "slice_index"):
        value = getattr(d, name, None)
        if value is not None:
            attrs[name] = tuple(value) if name == "coords" else int(value)
    for knob, name in ((knobs.DEVICE_COORDS, "coords"), (knobs.CORE_ON_CHIP, "core_on_chip"),
                       (knobs.SLICE_INDEX, "slice_index")):
        if knob.text():
            attrs[name] = knob.integers() if name == "coords" else knob.integer()
    return attrs


@dataclass(frozen=True)
class TpuDeviceProperties:
    name: str
    platform: str
    device_kind: str
    total_memory: int  # bytes; 0 when the backend does not report it (XLA:CPU)
    sparsecores: int  # 0 when the chip is not in tpu_facts' chip catalog (or not a TPU)
    tensorcores: int
    sparsecores_per_device: int = 0  # of this JAX device (a chip may show up as several)


def get_device_properties(device: int | str | torch.device | None = None) -> TpuDeviceProperties:
    """Name and size of the device, with SparseCore/TensorCore counts from the chip catalog."""
    from tpu_facts import CHIP_GENERATIONS

    _check_index(device)
    d = _jax_device()
    kind = d.device_kind.lower().replace("tpu ", "").replace(" ", "")
    chip = next((c for name, c in CHIP_GENERATIONS.items() if kind.startswith(name)), None)
    stats = d.memory_stats() or {}
    total = stats.get("bytes_limit", chip.hbm_bytes if chip else 0)
    return TpuDeviceProperties(
        name=get_device_name(),
        platform=d.platform,
        device_kind=d.device_kind,
        total_memory=int(total),
        sparsecores=chip.sparsecores_per_chip if chip else 0,
        tensorcores=chip.tensorcores_per_chip if chip else 0,
        sparsecores_per_device=chip.sparsecores_per_device if chip else 0,
    )


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes ``torch.autocast("tpu", dtype=...)`` accepts: bfloat16 (the default), float16, and
    the float8 value formats the device holds (``torch_tpu.runtime.dtypes.FLOAT8_DTYPES``, less
    ``float8_e8m0fnu``: exponent-only block scales, not a compute type; XLA upcasts float8 math
    where the chip has no native unit)."""
    scales = getattr(torch, "float8_e8m0fnu", None)
    return [torch.bfloat16, torch.float16, *(d for d in FLOAT8_DTYPES if d is not scales)]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# --- memory ---------------------------------------------------------------------------------

_peak = [0]


def memory_allocated(device: int | str | torch.device | None = None) -> int:
    """Bytes held by live arrays on the device (the backend's own count where it keeps one)."""
    _check_index(device)
    stats = _jax_device().memory_stats()
    if stats and "bytes_in_use" in stats:
        in_use = int(stats["bytes_in_use"])
    else:
        in_use = sum(a.nbytes for a in jax.live_arrays())
    _peak[0] = max(_peak[0], in_use)
    return in_use


def max_memory_allocated(device: int | str | torch.device | None = None) -> int:
    """Peak bytes in use: the backend's peak where reported, else the peak seen by these queries."""
    in_use = memory_allocated(device)
    stats = _jax_device().memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return max(_peak[0], in_use)


def reset_peak_memory_stats(device: int | str | torch.device | None = None) -> None:
    _check_index(device)
    _peak[0] = 0


def memory_reserved(device: int | str | torch.device | None = None) -> int:
    """Bytes the backend's allocator holds (in use or cached); without a pool that the backend
    reports (XLA:CPU), the bytes in use."""
    _check_index(device)
    stats = _jax_device().memory_stats() or {}
    return int(stats.get("bytes_reserved", stats.get("pool_bytes", memory_allocated())))


def max_memory_reserved(device: int | str | torch.device | None = None) -> int:
    """Peak of :func:`memory_reserved` (the backend's own peak where it reports one)."""
    reserved = memory_reserved(device)
    stats = _jax_device().memory_stats() or {}
    peak = stats.get("peak_bytes_reserved", stats.get("peak_pool_bytes"))
    return int(peak) if peak is not None else max(reserved, max_memory_allocated())


def mem_get_info(device: int | str | torch.device | None = None) -> tuple[int, int]:
    """``(free, total)`` bytes of device memory, as ``torch.cuda.mem_get_info``; host memory on
    backends that keep arrays there without reporting a limit (XLA:CPU)."""
    _check_index(device)
    stats = _jax_device().memory_stats() or {}
    if "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return total - int(stats.get("bytes_in_use", 0)), total
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def memory_stats(device: int | str | torch.device | None = None) -> dict[str, int]:
    allocated = memory_allocated(device)
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": max_memory_allocated(device),
        "reserved_bytes.all.current": memory_reserved(device),
        "reserved_bytes.all.peak": max_memory_reserved(device),
        "num_live_arrays": len(jax.live_arrays()),
    }


def empty_cache() -> None:
    gc.collect()
    host_heap.release()


# --- streams and events (JAX orders work per device; one stream, events wait for it) ----------


class Stream(torch.Stream):
    """The device's single in-order stream (JAX dispatches asynchronously, in order): a
    ``torch.Stream`` (stream id 0, what ``torch.accelerator.current_stream()`` gives)."""

    def __new__(cls, device: int | str | torch.device | None = None, priority: int = 0, **kwargs: Any) -> Stream:
        _check_index(device)
        return super().__new__(cls, device=torch.device(DEVICE_NAME, 0), priority=priority)

    def __init__(self, device: int | str | torch.device | None = None, priority: int = 0, **kwargs: Any) -> None:
        """``kwargs`` (TorchTPU's ``stream_id`` ...) name the one stream there is: accepted, unused."""
        self.priority = priority

    def synchronize(self) -> None:
        synchronize()

    def query(self) -> bool:
        return _done(last_output[0])

    def wait_stream(self, stream: Stream) -> None:
        pass  # one in-order stream: already ordered

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event


class Event(torch.Event):
    """Marks the point in the stream's work at record time; ``synchronize`` waits for it."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                external: bool = False, device: int | str | torch.device | None = None) -> Event:
        _check_index(device)
        return super().__new__(cls, device=torch.device(DEVICE_NAME, 0), enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False, device: int | str | torch.device | None = None) -> None:
        """``external`` (an event another process records, TorchTPU's flag) changes nothing here:
        one process drives the device and its work is in order."""
        self._marker: jax.Array | None = None
        self._time: float | None = None
        self.enable_timing = enable_timing

    def record(self, stream: Stream | None = None) -> None:
        self._marker = last_output[0]
        self._time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return _done(self._marker)

    def synchronize(self) -> None:
        _wait(self._marker)

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between the two record() calls (host clock; synchronize both first)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if self._time is None or end_event._time is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1000.0


_default_stream = None


def current_stream(device: int | str | torch.device | None = None) -> Stream:
    global _default_stream
    _check_index(device)
    if _default_stream is None:
        _default_stream = Stream()
    return _default_stream


default_stream = current_stream


def set_stream(stream: Stream) -> None:
    pass


@contextlib.contextmanager
def stream(stream: Stream | None) -> Iterator[None]:
    yield


@contextlib.contextmanager
def device(device: int | str | torch.device | None) -> Iterator[None]:
    _check_index(device)
    yield


@contextlib.contextmanager
def device_of(obj: Any) -> Iterator[None]:
    """``with torch.tpu.device_of(tensor):`` the block on ``obj``'s device (``torch.cuda.device_of``):
    a tpu tensor's is tpu:0, this process's one device; anything else leaves it as it is."""
    if isinstance(obj, torch.Tensor) and obj.device.type == DEVICE_NAME:
        _check_index(obj.device)
    yield


# --- matmul precision (torch_tpu.runtime.precision) -----------------------------------------

Precision = tpu_precision.Precision
precision = tpu_precision.precision
set_matmul_precision = tpu_precision.set_matmul_precision
get_matmul_precision = tpu_precision.get_matmul_precision


# --- random ----------------------------------------------------------------------------------

manual_seed = tpu_random.manual_seed
manual_seed_all = tpu_random.manual_seed
seed = tpu_random.seed
seed_all = tpu_random.seed
initial_seed = tpu_random.initial_seed


def get_rng_state(device: int | str | torch.device = "tpu") -> torch.Tensor:
    """The device's random state (a uint8 CPU tensor)."""
    _check_index(device)
    return tpu_random.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: int | str | torch.device = "tpu") -> None:
    """Restore a state :func:`get_rng_state` returned."""
    _check_index(device)
    tpu_random.set_rng_state(new_state)


class _DefaultGenerator(tpu_generator.TpuGenerator):
    """``torch.tpu.default_generators[0]``: the device's global random state (what ops without
    ``generator=`` draw from) as a ``torch.Generator``; an op given it draws from that stream too."""

    is_global_stream = True

    def manual_seed(self, seed: int) -> _DefaultGenerator:
        tpu_random.manual_seed(seed)
        super().manual_seed(seed)
        return self

    def seed(self) -> int:
        tpu_random.seed()
        return self.initial_seed()

    def initial_seed(self) -> int:
        return tpu_random.initial_seed()

    def get_state(self) -> torch.Tensor:
        return tpu_random.get_rng_state()

    def set_state(self, new_state: torch.Tensor) -> _DefaultGenerator:
        tpu_random.set_rng_state(new_state)
        return self


_default_generators: list[tuple[torch.Generator, ...]] = []


def get_default_generators() -> tuple[torch.Generator, ...]:
    if not _default_generators:
        _default_generators.append((_DefaultGenerator(),))
    return _default_generators[0]


get_rng_state_all = tpu_random.get_rng_state_all
set_rng_state_all = tpu_random.set_rng_state_all


# --- registration ----------------------------------------------------------------------------


def register() -> None:
    """Make "tpu" PyTorch's PrivateUse1 backend with this module as ``torch.tpu`` (idempotent)."""
    global _registered
    if _registered:
        return
    import sys

    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", DEVICE_NAME):
        raise RuntimeError(
            f"PrivateUse1 is already registered as {current!r} in this process; torch_tpu needs it as "
            f"'{DEVICE_NAME}' (e.g. torchax renames it to 'jax' and cannot share a process with torch_tpu)"
        )
    if current != DEVICE_NAME:
        torch.utils.rename_privateuse1_backend(DEVICE_NAME)
    if not hasattr(torch.Tensor, f"is_{DEVICE_NAME}"):  # else generated by the autoload hook already
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)  # storage.tpu(): see storage.py
    stand_in = getattr(torch, DEVICE_NAME, None)
    if stand_in is not None and hasattr(stand_in, "hand_over"):  # the autoload hook's (torchrec_tpu)
        stand_in.hand_over()
    torch._register_device_module(DEVICE_NAME, sys.modules[__name__])
    torch.accelerator.synchronize = _accelerator_synchronize
    host_hooks.register()  # the C++ hooks where they build (pinned host memory: DDP's static graph)
    tpu_generator.install()
    _registered = True
