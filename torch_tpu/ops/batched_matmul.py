"""Batched small matrix products (``aten.bmm``: DLRM's interaction and its gradients) with a fast
kernel on XLA:CPU.

XLA:CPU runs a dot with a batch of thousands of tiny products (27x64 @ 64x27) at ~12 GFLOP/s, a
fifth of CPU torch's ``bmm``. On the CPU platform :func:`batched_matmul` lowers such products to an
XLA FFI custom call (``csrc/batched_matmul.cc``, built on first use with the system C++ compiler
by ``xla_cache.native_build.build_library`` and cached); on any other platform (a TPU), and for large
products, dtypes the kernel lacks, or when no compiler is found (one warning), it is the plain
dot. The choice is made per platform at lowering (``jax.lax.platform_dependent``), so one traced
program serves both. Transposed operands are passed as flags, not materialised, and gradients
(under ``jax.grad``) are the same products with the transposes flipped.

Environment: ``TORCH_TPU_BMM_KERNEL=0`` keeps the plain dot everywhere.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path

from torch_tpu.ops.kernel_product import differentiable_product
from torch_tpu.runtime._jax import jax, jnp
from tpu_facts import knobs

SOURCE = Path(__file__).with_name("csrc") / "batched_matmul.cc"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden", "-w")
_TARGETS = {jnp.dtype(jnp.float32): "TorchTpuBatchedMatmulF32", jnp.dtype(jnp.bfloat16): "TorchTpuBatchedMatmulBF16"}
# Products with every dim at most this go to the kernel: it keeps one product's operands in L1/L2
# and beats XLA:CPU there; larger ones are XLA's blocked GEMM's job.
MAX_DIM = 256


def batched_matmul(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """``op(a) @ op(b)`` over a shared leading batch dim (3-D operands, op transposing the last two
    dims when its flag is set), accumulated in float32 for bfloat16 operands, in their dtype."""
    if a.ndim != 3 or b.ndim != 3:
        raise TypeError(f"batched_matmul: expected 3-D operands, got {a.ndim}-D and {b.ndim}-D")
    if a.dtype != b.dtype:
        raise TypeError(f"batched_matmul: expected operands of one dtype, got {a.dtype} and {b.dtype}")
    m, k = (a.shape[2], a.shape[1]) if trans_a else a.shape[1:]
    k2, n = (b.shape[2], b.shape[1]) if trans_b else b.shape[1:]
    if a.shape[0] != b.shape[0] or k != k2:
        raise ValueError(f"batched_matmul: shapes {a.shape} and {b.shape} do not multiply "
                         f"(trans_a={trans_a}, trans_b={trans_b})")
    if not _kernel_applies(a.dtype, m, n, k):
        return _dot(a, b, trans_a, trans_b)
    return _product(a, b, trans_a, trans_b)


def kernel_available() -> bool:
    """Whether the CPU kernel is built, loaded and registered with XLA (False: plain dots)."""
    return _register() is None


def export_checks() -> list:
    """What ``jax.export`` must admit for programs calling the kernel (its custom calls have no
    compatibility guarantee: stored programs name the kernel in their key, :func:`fingerprint`)."""
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in _TARGETS.values()]


def fingerprint() -> str:
    """What a stored program calling the kernel depends on: this module, the kernel's source and
    whether the kernel is in use (a program lowered with it cannot run where it is unavailable)."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + SOURCE.read_bytes()).hexdigest()[:16]
    return f"batched_matmul={kernel_available()}:{digest}"


def _kernel_applies(dtype, m: int, n: int, k: int) -> bool:
    return jnp.dtype(dtype) in _TARGETS and max(m, n, k) <= MAX_DIM and min(m, n) > 0 and kernel_available()


# half-precision products accumulate in float32 and round once, as CPU torch's do: XLA:CPU's dot
# with a bfloat16 result rounds differently (~0.03% of elements at 256 x 3,456 x 1,024) and runs at
# half the rate of the float32-accumulating one (24 vs 11 ms there; torch's bfloat16 mm: 15 ms)
ACCUMULATE_IN_F32 = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.matmul`` of operands of one dtype, half-precision ones accumulated in float32 and
    rounded once to their dtype."""
    if a.dtype in ACCUMULATE_IN_F32:
        return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
    return jnp.matmul(a, b)


def _dot(a, b, trans_a: bool, trans_b: bool) -> jax.Array:
    a = jnp.swapaxes(a, 1, 2) if trans_a else a
    b = jnp.swapaxes(b, 1, 2) if trans_b else b
    return matmul(a, b)


def _ffi(a, b, trans_a: bool, trans_b: bool) -> jax.Array:
    m = a.shape[2] if trans_a else a.shape[1]
    n = b.shape[1] if trans_b else b.shape[2]
    out = jax.ShapeDtypeStruct((a.shape[0], m, n), a.dtype)
    return jax.ffi.ffi_call(_TARGETS[jnp.dtype(a.dtype)], out)(a, b, trans_a=trans_a, trans_b=trans_b)


_product = differentiable_product(_ffi, _dot, batched_matmul)


@functools.cache
def _register() -> Exception | None:
    """Build, load and register the kernel once per process; the failure (if any) is returned."""
    from xla_cache.native_build import NativeUnavailable, register_cpu_ffi_targets

    if not knobs.BMM_KERNEL.on():
        return NativeUnavailable("disabled (TORCH_TPU_BMM_KERNEL=0)")  # asked for: no warning
    try:
        register_cpu_ffi_targets(SOURCE, "_torch_tpu_bmm", FLAGS, tuple(_TARGETS.values()))
    except (NativeUnavailable, OSError) as error:
        warnings.warn(f"torch_tpu: the CPU batched-matmul kernel is unavailable, bmm uses XLA's dot: {error}",
                      RuntimeWarning, stacklevel=2)
        return error
    return None
