"""Small-op overhead of the tpu device vs torch CPU eager and raw jax.numpy, all in one run.

Per op (64x64 float32) prints microseconds per call for: torch CPU eager, tpu eager with the
per-op jit cache (default), tpu eager with it off (``TORCH_TPU_OP_JIT=0`` behaviour), raw
``jax.numpy`` eager and the same jnp function under ``jax.jit``; then the ratios tpu/cpu and
tpu/jit (tpu eager vs a raw ``jax.jit`` call of the same jnp op; target <= 1.5x) and the
wrapper's own cost, tpu minus jitted jnp. The floor line is torch's own cost of a Python wrapper
subclass (a no-op ``__torch_dispatch__`` that only makes the result wrapper) and what it alone
would add to a raw ``jax.jit`` add; the second floor line runs the raw jitted add inside that no-op
``__torch_dispatch__`` (the least a wrapper device running one jitted program per op can cost here).
Timings on a shared machine are noisy: each repeat times every variant in turn (so load hits all
alike) and the best repeat counts; ``--clock cpu`` counts the process's CPU time (all its threads)
instead of wall time, steadier when other processes compete for the cores.
Usage: .venv/bin/python bench/bench_torch_tpu_ops.py [--iters N] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import time

import quiet_box
import torch

import torch_tpu
from torch_tpu.eager import op_jit
from torch_tpu.runtime._jax import jax, jnp

_CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def _time_all(fns: dict, iters: int, repeats: int = 7) -> dict[str, float]:
    """Best-of-``repeats`` mean microseconds per call of each ``(fn, sync)``, the variants timed in
    turn within each repeat."""
    for fn, sync in fns.values():
        for _ in range(max(10, iters // 10)):
            out = fn()
        sync(out)
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, (fn, sync) in fns.items():
            start = _clock()
            for _ in range(iters):
                out = fn()
            sync(out)
            best[name] = min(best[name], (_clock() - start) / iters * 1e6)
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
        "div_floor": (lambda: torch.div(a_cpu, b_cpu, rounding_mode="floor"),
                      lambda: torch.div(a_tpu, b_tpu, rounding_mode="floor"), lambda a, b: jnp.floor_divide(a, b)),
        # in-place rows last: they change a_tpu (and a_cpu), which the jnp columns do not see
        "add_inplace": (lambda: a_cpu.add_(b_cpu), lambda: a_tpu.add_(b_tpu), lambda a, b: a + b),
        "add_alpha_": (lambda: a_cpu.add_(b_cpu, alpha=0.5), lambda: a_tpu.add_(b_tpu, alpha=0.5),
                       lambda a, b: a + 0.5 * b),
        "t_contig": (lambda: a_cpu.t().contiguous(), lambda: a_tpu.t().contiguous(), lambda a, b: a.T.copy()),
        "col_add_": (lambda: a_cpu[:, ::2].add_(1.0), lambda: a_tpu[:, ::2].add_(1.0),
                     lambda a, b: a.at[:, ::2].add(1.0)),
    }, (a_j, b_j)


class _NoOp(torch.Tensor):
    """A wrapper subclass whose ``__torch_dispatch__`` only makes a new wrapper: torch's own cost of
    reaching Python dispatch and wrapping a result, the floor under any wrapper-tensor device."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch.Tensor._make_wrapper_subclass(_NoOp, args[0].shape, dtype=args[0].dtype, device=args[0].device)


class _JitNoOp(torch.Tensor):
    """:class:`_NoOp` that also runs a raw ``jax.jit`` add (``_JitNoOp.program`` on
    ``_JitNoOp.inputs``) inside ``__torch_dispatch__``: the floor of a wrapper-tensor device that
    runs each op as a jitted program. Interleaving torch's dispatch with JAX's costs more than the
    two apart (on this CPU host both get slower, cache pressure), so this is above noop + jit."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    program = inputs = None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.program(*cls.inputs)
        return torch.Tensor._make_wrapper_subclass(_JitNoOp, args[0].shape, dtype=args[0].dtype, device=args[0].device)


def _floors_us(iters: int, a_j, b_j, sync) -> dict[str, float]:
    """us per ``a + b``: of :class:`_NoOp` tensors (no computation at all), of :class:`_JitNoOp`
    tensors, and of the raw jitted add alone, timed together."""
    a, b = (torch.Tensor._make_wrapper_subclass(_NoOp, (64, 64), dtype=torch.float32, device="tpu:0")
            for _ in range(2))
    c, d = (torch.Tensor._make_wrapper_subclass(_JitNoOp, (64, 64), dtype=torch.float32, device="tpu:0")
            for _ in range(2))
    _JitNoOp.program, _JitNoOp.inputs = jax.jit(lambda x, y: x + y), (a_j, b_j)
    return _time_all({"noop": (lambda: a + b, lambda out=None: None),
                      "jit_noop": (lambda: c + d, lambda out=None: sync(_JitNoOp.program(a_j, b_j))),
                      "jit": (lambda: _JitNoOp.program(a_j, b_j), sync)}, iters)


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

    head = (f"{'op':<12} {'cpu':>7} {'tpu':>7} {'tpu-nojit':>9} {'jnp':>7} {'jnp-jit':>7} {'tpu/cpu':>7} "
            f"{'tpu/jit':>7} {'tpu-jit':>7}")
    print(f"us per op ({args.clock} clock), 64x64 float32;  tpu/jit = tpu eager / raw jax.jit of the same jnp op "
          "(target <= 1.5); tpu-jit = the wrapper's own cost")
    print(head)
    overheads, ratios = [], {}
    for name, (cpu_fn, tpu_fn, jnp_fn) in cases.items():
        jitted = jax.jit(jnp_fn)

        def plain(fn=tpu_fn):
            op_jit.set_enabled(False)
            try:
                return fn()
            finally:
                op_jit.set_enabled(True)

        t = _time_all({
            "cpu": (cpu_fn, no_sync), "tpu": (tpu_fn, jax_sync), "plain": (plain, jax_sync),
            "jnp": (lambda f=jnp_fn: f(a_j, b_j), jax_sync), "jit": (lambda f=jitted: f(a_j, b_j), jax_sync),
        }, args.iters)
        overheads.append(t["tpu"] - t["jit"])
        if name == "add":
            jit_add = t["jit"]
        ratios[name] = t["tpu"] / t["jit"]
        print(f"{name:<12} {t['cpu']:7.1f} {t['tpu']:7.1f} {t['plain']:9.1f} {t['jnp']:7.1f} {t['jit']:7.1f} "
              f"{t['tpu'] / t['cpu']:7.1f} {ratios[name]:7.2f} {t['tpu'] - t['jit']:7.1f}")
    floors = _floors_us(args.iters, a_j, b_j, jax_sync)
    floor = floors["noop"]
    print(f"floor: torch's Python-subclass dispatch alone (no-op __torch_dispatch__ making a wrapper) "
          f"{floor:.1f} us/op; floor/jit for add: {(floor + jit_add) / jit_add:.2f}x")
    print(f"floor with the jitted add run inside that no-op __torch_dispatch__: {floors['jit_noop']:.1f} us/op "
          f"= {floors['jit_noop'] / floors['jit']:.2f}x its raw jit ({floors['jit']:.1f} us), "
          f"{floors['jit_noop'] - floors['jit'] - floor:+.1f} us over noop + jit from interleaving the two alone")
    small = sorted(ratios[n] for n in ("add", "mul_scalar", "relu", "sum_dim"))
    print(f"small ops (add, mul_scalar, relu, sum_dim) tpu/jit: median {(small[1] + small[2]) / 2:.2f}x, "
          f"worst {small[-1]:.2f}x (target <= 1.5x); median wrapper cost (tpu - jitted jnp): "
          f"{sorted(overheads)[len(overheads) // 2]:.1f} us/op; op jit cache: {op_jit.stats()}")


if __name__ == "__main__":
    quiet_box.run(main)
