"""Small-op overhead of the tpu device vs torch CPU eager and raw jax.numpy, all in one run.

Per op (64x64 float32) prints microseconds per call for: torch CPU eager, tpu eager with the
per-op jit cache (default), tpu eager with it off (``TORCH_TPU_OP_JIT=0`` behaviour), raw
``jax.numpy`` eager and the same jnp function under ``jax.jit``; then the ratios tpu/cpu and the
wrapper's own cost, tpu minus jitted jnp (goal: within ~15 us/op on a 2-core box).
Timings on a shared machine are noisy: best of several repeats; ``--clock cpu`` counts the process's
CPU time (all its threads) instead of wall time, steadier when other processes compete for the cores.
Usage: .venv/bin/python bench/bench_torch_tpu_ops.py [--iters N] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_tpu
from torch_tpu import op_jit
from torch_tpu._jax import jax, jnp

_CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def _time(fn, iters: int, sync, repeats: int = 5) -> float:
    """Best-of-``repeats`` mean microseconds per call (the least disturbed by other processes)."""
    for _ in range(max(10, iters // 10)):
        out = fn()
    sync(out)
    best = float("inf")
    for _ in range(repeats):
        start = _clock()
        for _ in range(iters):
            out = fn()
        sync(out)
        best = min(best, (_clock() - start) / iters * 1e6)
    return best


_clock = time.perf_counter


def _cases():
    a_cpu, b_cpu = torch.randn(64, 64), torch.randn(64, 64)
    a_tpu, b_tpu = a_cpu.to("tpu"), b_cpu.to("tpu")
    a_j, b_j = torch_tpu.to_jax(a_tpu), torch_tpu.to_jax(b_tpu)
    # name: (cpu fn, tpu fn, jnp fn of (a, b))
    return {
        "add": (lambda: a_cpu + b_cpu, lambda: a_tpu + b_tpu, lambda a, b: a + b),
        "mul_scalar": (lambda: a_cpu * 2.0, lambda: a_tpu * 2.0, lambda a, b: a * 2.0),
        "relu": (lambda: a_cpu.relu(), lambda: a_tpu.relu(), lambda a, b: jnp.maximum(a, 0)),
        "mm": (lambda: a_cpu @ b_cpu, lambda: a_tpu @ b_tpu, lambda a, b: a @ b),
        "sum_dim": (lambda: a_cpu.sum(1), lambda: a_tpu.sum(1), lambda a, b: a.sum(1)),
        "add_inplace": (lambda: a_cpu.add_(b_cpu), lambda: a_tpu.add_(b_tpu), lambda a, b: a + b),
        "t_contig": (lambda: a_cpu.t().contiguous(), lambda: a_tpu.t().contiguous(), lambda a, b: a.T.copy()),
        "col_add_": (lambda: a_cpu[:, ::2].add_(1.0), lambda: a_tpu[:, ::2].add_(1.0),
                     lambda a, b: a.at[:, ::2].add(1.0)),
    }, (a_j, b_j)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--clock", choices=sorted(_CLOCK), default="wall")
    args = parser.parse_args()
    global _clock
    _clock = _CLOCK[args.clock]
    cases, (a_j, b_j) = _cases()

    def no_sync(out=None):
        pass

    def jax_sync(out=None):
        if out is not None:
            jax.block_until_ready(torch_tpu.to_jax(out) if isinstance(out, torch.Tensor) else out)

    head = f"{'op':<12} {'cpu':>7} {'tpu':>7} {'tpu-nojit':>9} {'jnp':>7} {'jnp-jit':>7} {'tpu/cpu':>7} {'tpu-jit':>7}"
    print(f"us per op ({args.clock} clock), 64x64 float32;  tpu-jit = tpu minus jitted jnp (the wrapper's own cost)")
    print(head)
    overheads = []
    for name, (cpu_fn, tpu_fn, jnp_fn) in cases.items():
        jitted = jax.jit(jnp_fn)
        t_cpu = _time(cpu_fn, args.iters, no_sync)
        op_jit.set_enabled(False)
        t_plain = _time(tpu_fn, args.iters, jax_sync)
        op_jit.set_enabled(True)
        t_tpu = _time(tpu_fn, args.iters, jax_sync)
        t_jnp = _time(lambda: jnp_fn(a_j, b_j), args.iters, jax_sync)
        t_jit = _time(lambda: jitted(a_j, b_j), args.iters, jax_sync)
        overheads.append(t_tpu - t_jit)
        print(f"{name:<12} {t_cpu:7.1f} {t_tpu:7.1f} {t_plain:9.1f} {t_jnp:7.1f} {t_jit:7.1f} "
              f"{t_tpu / t_cpu:7.1f} {t_tpu - t_jit:7.1f}")
    print(f"median wrapper cost (tpu - jitted jnp): {sorted(overheads)[len(overheads) // 2]:.1f} us/op; "
          f"op jit cache: {op_jit.stats()}")


if __name__ == "__main__":
    main()
