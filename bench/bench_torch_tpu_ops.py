"""Small-op dispatch overhead of the tpu device vs torch CPU eager and raw jax.numpy (same run).

Prints microseconds per op and the ratios tpu/cpu and tpu-minus-jnp (the wrapper's own cost;
goal: within ~15 us/op on a 2-core box). Timings on a shared machine are noisy.
Usage: .venv/bin/python bench/bench_torch_tpu_ops.py [--iters N]
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_tpu
from torch_tpu._jax import jax, jnp


def _time(fn, iters: int, sync, repeats: int = 5) -> float:
    """Best-of-``repeats`` mean microseconds per call (the least disturbed by other processes)."""
    for _ in range(max(10, iters // 10)):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn()
        sync(out)
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    a_cpu, b_cpu = torch.randn(64, 64), torch.randn(64, 64)
    a_tpu, b_tpu = a_cpu.to("tpu"), b_cpu.to("tpu")
    a_j, b_j = torch_tpu.to_jax(a_tpu), torch_tpu.to_jax(b_tpu)
    cases = {
        "add": (lambda: a_cpu + b_cpu, lambda: a_tpu + b_tpu, lambda: a_j + b_j),
        "mul_scalar": (lambda: a_cpu * 2.0, lambda: a_tpu * 2.0, lambda: a_j * 2.0),
        "relu": (lambda: a_cpu.relu(), lambda: a_tpu.relu(), lambda: jnp.maximum(a_j, 0)),
        "mm": (lambda: a_cpu @ b_cpu, lambda: a_tpu @ b_tpu, lambda: a_j @ b_j),
        "sum_dim": (lambda: a_cpu.sum(1), lambda: a_tpu.sum(1), lambda: a_j.sum(1)),
        "add_inplace": (lambda: a_cpu.add_(b_cpu), lambda: a_tpu.add_(b_tpu), lambda: a_j + b_j),
        "view_t": (lambda: a_cpu.t(), lambda: a_tpu.t(), lambda: a_j.T),
    }

    def no_sync(out=None):
        pass

    def jax_sync(out=None):
        if out is not None:
            jax.block_until_ready(torch_tpu.to_jax(out) if isinstance(out, torch.Tensor) else out)

    print(f"{'op':<12} {'cpu us':>8} {'tpu us':>8} {'jnp us':>8} {'tpu/cpu':>8} {'tpu-jnp us':>11}")
    for name, (cpu_fn, tpu_fn, jnp_fn) in cases.items():
        t_cpu = _time(cpu_fn, args.iters, no_sync)
        t_tpu = _time(tpu_fn, args.iters, jax_sync)
        t_jnp = _time(jnp_fn, args.iters, jax_sync)
        print(f"{name:<12} {t_cpu:8.1f} {t_tpu:8.1f} {t_jnp:8.1f} {t_tpu / t_cpu:8.1f} {t_tpu - t_jnp:11.1f}")


if __name__ == "__main__":
    main()
