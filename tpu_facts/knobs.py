"""Every environment variable the project reads, in one place: its name, default, meaning and the
package that reads it. Code reads a variable through its :class:`Knob` (``knobs.EAGER_MODE.text()``),
so this list is complete (``tests/test_layering.py`` checks that no other module names or reads
one); docs/ENVIRONMENT.md is its table (``tests/tpu_facts/test_knobs.py`` keeps the two equal).

Here, in the lowest package (standard library only), so that every package can read its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_OFF = ("0", "off", "false", "no")


@dataclass(frozen=True)
class Knob:
    """One environment variable: ``name``, the ``default`` text when unset (None: no value), what
    it does (``doc``) and the package that reads it (``package``)."""

    name: str
    default: str | None
    doc: str
    package: str = "torch_tpu"

    def value(self) -> str | None:
        """The value as set, stripped (empty when set empty); None when unset (no default applied)."""
        value = os.environ.get(self.name)
        return None if value is None else value.strip()

    def text(self) -> str | None:
        """The value, stripped; the default when unset or empty."""
        return self.value() or self.default

    def on(self) -> bool:
        """A switch: on unless the value is one of 0/off/false/no (or unset with such a default)."""
        return (self.text() or "0").lower() not in _OFF

    def integer(self) -> int:
        """The value as an integer; ValueError naming the variable otherwise."""
        text = self.text()
        try:
            return int(text)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}={text!r}: expected an integer") from None


EAGER_MODE = Knob("TORCH_TPU_EAGER_MODE", "strict", "eager mode at start: strict, debug or defer_and_fuse")
NO_FALLBACK = Knob("TORCH_TPU_NO_FALLBACK", "0", "1: an op without a tpu lowering raises instead of running on CPU")
OP_JIT = Knob("TORCH_TPU_OP_JIT", "1", "0: eager ops run their plain lowering, without the per-signature program cache")
OP_JIT_MAX = Knob("TORCH_TPU_OP_JIT_MAX", "1024", "eager op programs kept, least recently used out first")
DEFER_MAX_OPS = Knob("TORCH_TPU_DEFER_MAX_OPS", "512", "ops one defer_and_fuse program holds at most")
SPECIALIZE_WARN = Knob("TORCH_TPU_SPECIALIZE_WARN", "8", "shape specializations of one graph before a warning")
DUMP_HLO = Knob("TORCH_TPU_DUMP_HLO", None, "a folder where each compiled graph's StableHLO is written")
JAX_TRACEBACKS = Knob("TORCH_TPU_JAX_TRACEBACKS", "0", "1: JAX keeps native Python tracebacks (debugging; they pin "
                      "compiled code in memory)")
HOST_HEAP = Knob("TORCH_TPU_HOST_HEAP", "1", "0: on XLA:CPU, malloc unmaps large freed blocks as usual instead of "
                  "keeping them for the next program run")
BMM_KERNEL = Knob("TORCH_TPU_BMM_KERNEL", "1", "0: batched small matmuls use XLA's dot, not the FFI kernel (CPU)")
SPARSECORES_PER_DEVICE = Knob("TORCH_TPU_SPARSECORES_PER_DEVICE", None,
                              "SparseCores per device emulated where the device has none (default 2)")
DEVICE_COORDS = Knob("TORCH_TPU_DEVICE_COORDS", None, "this process' device torus coordinates, 'x,y,z'")
CORE_ON_CHIP = Knob("TORCH_TPU_CORE_ON_CHIP", None, "this process' device core index on its chip")
SLICE_INDEX = Knob("TORCH_TPU_SLICE_INDEX", None, "this process' slice (multislice)")
DIST_TRANSPORT = Knob("TPU_DIST_TRANSPORT", "auto", "how tpu_dist moves tpu tensors: auto, xla or gloo")
DIST_COORDINATOR_HOST = Knob("TPU_DIST_XLA_COORDINATOR_HOST", None,
                             "host of the multi-controller JAX coordinator (default: MASTER_ADDR)")
DIST_PORT_OFFSET = Knob("TPU_DIST_XLA_PORT_OFFSET", "1", "the coordinator's port: MASTER_PORT plus this")

# --- read below torch_tpu and above it ----------------------------------------------------------------

COMPILE_CACHE = Knob("TORCH_TPU_COMPILE_CACHE", None, "the persistent compile cache's folder (default "
                     "$XDG_CACHE_HOME/torch_tpu/compile, else ~/.cache/torch_tpu/compile); off/0/false/none "
                     "(or empty) disables it", "xla_cache")
COMPILE_CACHE_MAX_MB = Knob("TORCH_TPU_COMPILE_CACHE_MAX_MB", "2048", "size cap per compile-cache level, in MiB",
                            "xla_cache")
NATIVE_CACHE = Knob("TORCHREC_TPU_NATIVE_CACHE", None, "folder of the built C++ libraries (default "
                    "$XDG_CACHE_HOME/torchrec-tpu/native, else ~/.cache/torchrec-tpu/native)", "xla_cache")
NATIVE_BUILD_TIMEOUT = Knob("TORCHREC_TPU_NATIVE_BUILD_TIMEOUT", "300", "seconds a C++ library's first-use build "
                            "may take; then the compiler is killed and the XLA (or numpy) path is used",
                            "xla_cache")
NATIVE = Knob("TORCHREC_TPU_NATIVE", "1", "0: sparsecore's host preprocessing runs its numpy path, not the "
              "compiled extension", "sparsecore")
ROW_KERNEL = Knob("TORCHREC_TPU_ROW_KERNEL", "1", "0: the SparseCore ops' table row gathers and scatters use XLA's, "
                  "not the FFI kernels (CPU)", "sparsecore")
DATA_CACHE = Knob("TORCHREC_TPU_CACHE", None, "folder of generated synthetic data (default ~/.cache/torchrec_tpu)",
                  "pipelines")
PROGRESS_SECONDS = Knob("TORCHREC_TPU_PROGRESS_SECONDS", "30", "seconds between the jobs' progress lines when "
                        "not on a terminal (train, infer, data convert)", "pipelines")
AUTOLOAD = Knob("TORCH_TPU_AUTOLOAD", "0", "1: import torch loads torch_tpu (PyTorch's device-backend "
                "autoload)", "torchrec_tpu")
ERROR_LOG_DIR = Knob("TORCHREC_TPU_ERROR_LOG_DIR", None, "folder of the torchrec-tpu commands' error logs "
                     "(default: the temp folder's torchrec-tpu-logs)", "torchrec_tpu")

KNOBS: tuple[Knob, ...] = tuple(v for v in globals().values() if isinstance(v, Knob))
