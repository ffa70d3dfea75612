"""2-D matrix products (``aten.mm``/``addmm``: the towers' linear layers) on the BLAS CPU torch runs,
inside XLA:CPU programs of a process bound to one core (a rank of several on one host).

On one core XLA:CPU's own dot runs a float32 GEMM at 0.77-0.93x of MKL's sgemm (DLRM's towers at
256 x 1,024 x 1,024: 93 against 117 GFLOP/s), the core a rank's towers in CPU torch get. There
:func:`gemm` lowers to an XLA FFI custom call (``csrc/host_gemm.cc``) that calls MKL's
``sgemm``/``cblas_gemm_bf16bf16f32`` from the libtorch_cpu already in the process (the anchor's
dense step on one core: +7%). With more cores it stays XLA's dot: its own threads beat MKL's beside
them (on two cores, mlperf's one-program step ran 0.80x TorchRec with the kernel, 1.35x without). On
any other platform (a TPU), and for products too small to pay for the call, it is the plain dot
(``jax.lax.platform_dependent``: one traced program serves both). Transposes are flags, gradients
the same products with flags flipped.

Environment: ``TORCH_TPU_HOST_GEMM=0`` keeps XLA's dot everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import warnings
from pathlib import Path

from torch_tpu.ops.kernel_product import differentiable_product
from torch_tpu.runtime._jax import jax, jnp
from tpu_facts import knobs

SOURCE = Path(__file__).with_name("csrc") / "host_gemm.cc"
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-w")
_TARGETS = {jnp.dtype(jnp.float32): "TorchTpuHostGemmF32", jnp.dtype(jnp.bfloat16): "TorchTpuHostGemmBF16"}
# Below this many multiply-adds a product stays XLA's dot (the call costs more than it saves).
MIN_MACS = 1 << 22


def gemm(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """``op(a) @ op(b)`` of 2-D operands of one dtype, float32 or bfloat16, accumulated in float32;
    the result is float32 (a bfloat16 caller rounds once)."""
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    if not applies(a, b) or m * n * k < MIN_MACS:
        return _dot(a, b, trans_a, trans_b)
    return _product(a, b, trans_a, trans_b)


def applies(a: jax.Array, b: jax.Array) -> bool:
    """Whether :func:`gemm` calls the kernel for these operands (2-D, one dtype it has, in use)."""
    return a.ndim == 2 and b.ndim == 2 and a.dtype == b.dtype and jnp.dtype(a.dtype) in _TARGETS and in_use()


def in_use() -> bool:
    """Whether this process' programs call the kernel: built, and the process bound to one CPU."""
    return len(os.sched_getaffinity(0)) == 1 and kernel_available()


def kernel_available() -> bool:
    """Whether the kernel is built, bound to MKL and registered with XLA (False: plain dots)."""
    return _register() is None


def export_checks() -> list:
    """What ``jax.export`` must admit for programs calling the kernel."""
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in _TARGETS.values()]


def fingerprint() -> str:
    """What a stored program calling the kernel depends on (see ``batched_matmul.fingerprint``):
    whether the kernel is available (fixed for the process: a program calling it must never load
    where it is not) and whether it is in use (the CPU affinity when the key is taken)."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + SOURCE.read_bytes()).hexdigest()[:16]
    return f"host_gemm={kernel_available()},{in_use()}:{digest}"


def _dot(a, b, trans_a: bool, trans_b: bool) -> jax.Array:
    a = a.T if trans_a else a
    b = b.T if trans_b else b
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def _ffi(a, b, trans_a: bool, trans_b: bool) -> jax.Array:
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    out = jax.ShapeDtypeStruct((m, n), jnp.float32)
    return jax.ffi.ffi_call(_TARGETS[jnp.dtype(a.dtype)], out)(a, b, trans_a=trans_a, trans_b=trans_b)


_product = differentiable_product(_ffi, _dot, gemm)


def _mkl_routines() -> tuple[int, int, int]:
    """The addresses of MKL's sgemm, bf16 GEMM and local-threads setter in the loaded libtorch_cpu."""
    import torch

    from xla_cache.native_build import NativeUnavailable

    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        library = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        names = ("sgemm_", "cblas_gemm_bf16bf16f32", "MKL_Set_Num_Threads_Local")
        return tuple(ctypes.cast(getattr(library, name), ctypes.c_void_p).value for name in names)
    except (OSError, AttributeError) as error:
        raise NativeUnavailable(f"torch's MKL GEMM routines are not found in {path}: {error}") from error


@functools.cache
def _register() -> Exception | None:
    """Build, load, bind and register the kernel once per process; the failure (if any) is returned."""
    from xla_cache.native_build import NativeUnavailable, register_cpu_ffi_targets

    if not knobs.HOST_GEMM.on():
        return NativeUnavailable("disabled (TORCH_TPU_HOST_GEMM=0)")  # asked for: no warning
    try:
        routines = _mkl_routines()
        library = register_cpu_ffi_targets(SOURCE, "_torch_tpu_host_gemm", FLAGS, tuple(_TARGETS.values()))
        library.torch_tpu_host_gemm_bind(*(ctypes.c_void_p(address) for address in routines))
    except (NativeUnavailable, OSError) as error:
        warnings.warn(f"torch_tpu: the CPU GEMM kernel is unavailable, mm uses XLA's dot: {error}",
                      RuntimeWarning, stacklevel=2)
        return error
    return None
