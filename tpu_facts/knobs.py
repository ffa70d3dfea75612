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
_ON = ("1", "on", "true", "yes")


class KnobError(ValueError):
    """A variable holds a value its knob does not take; ``str()`` names the variable, the value and
    what the knob takes."""


@dataclass(frozen=True)
class Knob:
    """One environment variable: ``name``, the ``default`` text when unset (None: no value), what
    it does (``doc``) and the package that reads it (``package``). A knob that takes a closed set of
    values declares its ``kind``: ``integer``, ``integers`` (1 to ``items`` comma-separated ones)
    or ``number`` with the range it takes (``minimum``, ``maximum``), ``choice`` with its
    ``choices``, or ``switch`` (:meth:`on`); :meth:`read` reads it by its kind, checked."""

    name: str
    default: str | None
    doc: str
    package: str = "torch_tpu"
    kind: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    items: int = 1
    choices: tuple[str, ...] = ()

    def read(self) -> int | float | tuple[int, ...] | str | bool:
        """The value (its default when unset), by the knob's ``kind``, checked against what it takes."""
        readers = {"integer": self.integer, "integers": self.integers, "number": self.number, "choice": self.choice,
                   "switch": self.switch}
        if self.kind not in readers:
            raise TypeError(f"{self.name} takes free text (kind={self.kind!r})")
        return readers[self.kind]()

    def takes(self) -> str:
        """What the knob takes, as its errors and docs/ENVIRONMENT.md say it (``an integer >= 1``);
        empty for free text."""
        return "" if self.kind is None else self._expected(self.kind)

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

    def switch(self) -> bool:
        """:meth:`on`, refusing a value that is neither an on nor an off word (``maybe`` read as on)."""
        if (self.text() or "0").lower() not in _ON + _OFF:
            self._refuse("switch")
        return self.on()

    def choice(self) -> str:
        """The value, lowercased, one of the knob's ``choices``."""
        text = (self.text() or "").lower()
        if text not in self.choices:
            self._refuse("choice")
        return text

    def integer(self) -> int:
        """The value as an integer in the knob's range; :class:`KnobError` naming the variable otherwise."""
        (value,) = self._numbers(int, "integer", [self.text()])
        return value

    def integers(self) -> tuple[int, ...]:
        """The value as 1 to ``items`` comma-separated integers, each in the knob's range."""
        parts = (self.text() or "").split(",")
        if len(parts) > self.items:
            self._refuse("integers")
        return tuple(self._numbers(int, "integers", parts))

    def number(self) -> float:
        """The value as a number in the knob's range (NaN is in none)."""
        (value,) = self._numbers(float, "number", [self.text()])
        return value

    def _numbers(self, parse: type, kind: str, parts: list[str | None]) -> list:
        try:
            values = [parse(part) for part in parts]  # type: ignore[arg-type]
        except (TypeError, ValueError):
            self._refuse(kind)
        low, high = self.minimum, self.maximum
        if any(not ((low is None or low <= v) and (high is None or v <= high) and v == v) for v in values):
            self._refuse(kind)
        return values

    def _refuse(self, kind: str) -> None:
        raise KnobError(f"{self.name}={self.text()!r}: expected {self._expected(kind)}")

    def _expected(self, kind: str) -> str:
        if kind == "switch":
            return f"one of {', '.join(_ON)} (on) or {', '.join(_OFF)} (off)"
        if kind == "choice":
            return f"one of {', '.join(self.choices)}"
        what = {"integer": "an integer", "integers": f"1 to {self.items} comma-separated integers",
                "number": "a number"}[kind]
        low, high = (None if v is None else f"{v:g}" for v in (self.minimum, self.maximum))
        if low is not None and high is not None:
            return f"{what} in [{low}, {high}]"
        return what + (f" >= {low}" if low is not None else f" <= {high}" if high is not None else "")


EAGER_MODE = Knob("TORCH_TPU_EAGER_MODE", "strict", "eager mode at start: strict, debug or defer_and_fuse",
                  kind="choice", choices=("strict", "debug", "defer_and_fuse"))
NO_FALLBACK = Knob("TORCH_TPU_NO_FALLBACK", "0", "1: an op without a tpu lowering raises instead of running on CPU",
                   kind="switch")
OP_JIT = Knob("TORCH_TPU_OP_JIT", "1", "0: eager ops run their plain lowering, without the per-signature program cache",
              kind="switch")
OP_JIT_MAX = Knob("TORCH_TPU_OP_JIT_MAX", "1024", "eager op programs kept, least recently used out first",
                  kind="integer", minimum=1)
DEFER_MAX_OPS = Knob("TORCH_TPU_DEFER_MAX_OPS", "512", "ops one defer_and_fuse program holds at most",
                     kind="integer", minimum=1)
SPECIALIZE_WARN = Knob("TORCH_TPU_SPECIALIZE_WARN", "8", "shape specializations of one graph before a warning",
                       kind="integer", minimum=1)
DUMP_HLO = Knob("TORCH_TPU_DUMP_HLO", None, "a folder where each compiled graph's StableHLO is written")
JAX_TRACEBACKS = Knob("TORCH_TPU_JAX_TRACEBACKS", "0", "1: JAX keeps native Python tracebacks (debugging; they pin "
                      "compiled code in memory)", kind="switch")
HOST_HEAP = Knob("TORCH_TPU_HOST_HEAP", "1", "0: on XLA:CPU, malloc unmaps large freed blocks as usual instead of "
                  "keeping them for the next program run", kind="switch")
BMM_KERNEL = Knob("TORCH_TPU_BMM_KERNEL", "1", "0: batched small matmuls use XLA's dot, not the FFI kernel (CPU)",
                  kind="switch")
HOST_GEMM = Knob("TORCH_TPU_HOST_GEMM", "1", "0: 2-D matmuls in compiled programs use XLA's dot, not MKL's GEMM "
                 "through an FFI kernel (CPU)", kind="switch")
SPARSECORES_PER_DEVICE = Knob("TORCH_TPU_SPARSECORES_PER_DEVICE", None,
                              "SparseCores per device emulated where the device has none (default 2)",
                              kind="integer", minimum=1)
DEVICE_COORDS = Knob("TORCH_TPU_DEVICE_COORDS", None, "this process' device torus coordinates, 'x,y,z'",
                     kind="integers", minimum=0, items=3)
CORE_ON_CHIP = Knob("TORCH_TPU_CORE_ON_CHIP", None, "this process' device core index on its chip", kind="integer",
                    minimum=0)
SLICE_INDEX = Knob("TORCH_TPU_SLICE_INDEX", None, "this process' slice (multislice)", kind="integer", minimum=0)
DIST_TRANSPORT = Knob("TPU_DIST_TRANSPORT", "auto", "how tpu_dist moves tpu tensors: auto, xla or gloo",
                      kind="choice", choices=("auto", "xla", "gloo"))
DIST_COORDINATOR_HOST = Knob("TPU_DIST_XLA_COORDINATOR_HOST", None,
                             "host of the multi-controller JAX coordinator (default: MASTER_ADDR)")
DIST_PORT_OFFSET = Knob("TPU_DIST_XLA_PORT_OFFSET", "1", "the coordinator's port: MASTER_PORT plus this",
                        kind="integer", minimum=1, maximum=65534)

# --- read below torch_tpu and above it ----------------------------------------------------------------

COMPILE_CACHE = Knob("TORCH_TPU_COMPILE_CACHE", None, "the persistent compile cache's folder (default "
                     "$XDG_CACHE_HOME/torch_tpu/compile, else ~/.cache/torch_tpu/compile); off/0/false/none "
                     "(or empty) disables it", "xla_cache")
COMPILE_CACHE_MAX_MB = Knob("TORCH_TPU_COMPILE_CACHE_MAX_MB", "2048", "size cap per compile-cache level, in MiB",
                            "xla_cache", kind="integer", minimum=1)
NATIVE_CACHE = Knob("TORCHREC_TPU_NATIVE_CACHE", None, "folder of the built C++ libraries (default "
                    "$XDG_CACHE_HOME/torchrec-tpu/native, else ~/.cache/torchrec-tpu/native)", "xla_cache")
NATIVE_BUILD_TIMEOUT = Knob("TORCHREC_TPU_NATIVE_BUILD_TIMEOUT", "300", "seconds a C++ library's first-use build "
                            "may take; then the compiler is killed and the XLA (or numpy) path is used",
                            "xla_cache", kind="number", minimum=1, maximum=86400)
NATIVE = Knob("TORCHREC_TPU_NATIVE", "1", "0: sparsecore's host preprocessing runs its numpy path, not the "
              "compiled extension", "sparsecore")
ROW_KERNEL = Knob("TORCHREC_TPU_ROW_KERNEL", "1", "0: the SparseCore ops' table row gathers and scatters use XLA's, "
                  "not the FFI kernels (CPU)", "sparsecore")
DATA_CACHE = Knob("TORCHREC_TPU_CACHE", None, "folder of generated synthetic data (default ~/.cache/torchrec_tpu)",
                  "pipelines")
PROGRESS_SECONDS = Knob("TORCHREC_TPU_PROGRESS_SECONDS", "30", "seconds between the jobs' progress lines when "
                        "not on a terminal (train, infer, data convert)", "pipelines", kind="number", minimum=0)
AUTOLOAD = Knob("TORCH_TPU_AUTOLOAD", "1", "0: import torch leaves the \"tpu\" device unregistered (PyTorch's "
                "device-backend autoload; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns every backend's off)", "torchrec_tpu")
ERROR_LOG_DIR = Knob("TORCHREC_TPU_ERROR_LOG_DIR", None, "folder of the torchrec-tpu commands' error logs "
                     "(default: the temp folder's torchrec-tpu-logs)", "torchrec_tpu")

KNOBS: tuple[Knob, ...] = tuple(v for v in globals().values() if isinstance(v, Knob))


def check_set(package: str) -> None:
    """Read every knob of ``package`` with a ``kind`` that is set: a value it does not take raises
    :class:`KnobError` now (at the package's import), not when the value is first used."""
    for knob in KNOBS:
        if knob.package == package and knob.kind is not None and knob.value():
            knob.read()
