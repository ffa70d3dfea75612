"""The recsys Pallas kernels' plain-XLA paths vs the compiled torch formulation they replace.

Interpret-mode timings of the Pallas kernels themselves say nothing about TPU speed (interpret mode
runs the kernel body as unfused XLA loops on the CPU), so they are not measured. What is measured,
in one run on the tpu device: the torch formulation of each kernel under
``torch.compile(backend="tpu")`` (the non-Pallas reference a user would write) vs the kernel's plain
XLA fallback (``*_reference`` under ``jax.jit``), forward only, microseconds per call and the ratio.
Usage: .venv/bin/python bench/bench_pallas_kernels.py [--batch 2048] [--iters 50]
"""

from __future__ import annotations

import argparse
import time

import quiet_box
import torch
import torch.nn.functional as F

import torch_tpu.compile  # noqa: F401  (registers backend="tpu")
from torch_tpu.ops import pallas as tp
from torch_tpu.runtime._jax import jax, jnp
from torch_tpu.runtime.tensor import to_jax


def _best_us(fn, iters: int, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(to_jax(out) if isinstance(out, torch.Tensor) else out)
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def _torch_interaction(x, rows, cols):
    return torch.bmm(x, x.transpose(1, 2))[:, rows, cols]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    b = args.batch
    torch.manual_seed(0)

    vocab, dim, per_bag = 100_000, 64, 4
    table = torch.randn(vocab, dim)
    ids = torch.randint(0, vocab, (b * per_bag,))
    offsets = torch.arange(0, b * per_bag, per_bag)
    pointers = torch.cat([offsets, torch.tensor([b * per_bag])])
    gains = torch.ones(b * per_bag)
    x = torch.randn(b, 27, dim)
    x0 = torch.randn(b, 512)
    v, w, bias = torch.randn(128, 512), torch.randn(512, 128), torch.randn(512)

    cases = {
        "embedding_bag_csr": (
            lambda t, i, o, g: F.embedding_bag(i, t, o, mode="sum", per_sample_weights=g),
            (table, ids, offsets, gains),
            tp.embedding_bag_csr_reference, (table, ids, pointers, gains)),
        "dot_interaction": (_torch_interaction, (x, *torch.triu_indices(27, 27, 1)), tp.dot_interaction_reference,
                            (x,)),
        "low_rank_cross": (
            lambda a, c, vv, ww, bb: a * ((c @ vv.T) @ ww.T + bb) + c, (x0, x0, v, w, bias),
            tp.low_rank_cross_reference, (x0, x0, v, w, bias)),
    }
    print(f"batch {b}; microseconds per forward call (best of 5 x {args.iters}); Pallas interpret mode not timed")
    print(f"{'kernel':<20}{'torch.compile(tpu)':>20}{'XLA path (jax.jit)':>20}{'ratio':>8}")
    for name, (torch_fn, torch_args, xla_fn, xla_args) in cases.items():
        on_tpu = [a.to("tpu") for a in torch_args]
        compiled = torch.compile(torch_fn, backend="tpu")
        t_torch = _best_us(lambda: compiled(*on_tpu), args.iters)
        arrays = [jnp.asarray(a.numpy()) for a in xla_args]
        jitted = jax.jit(xla_fn)
        t_xla = _best_us(lambda: jitted(*arrays), args.iters)
        print(f"{name:<20}{t_torch:>20.1f}{t_xla:>20.1f}{t_torch / t_xla:>7.2f}x")


if __name__ == "__main__":
    quiet_box.run(main)
