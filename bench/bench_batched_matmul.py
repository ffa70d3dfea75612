"""The tpu device's batched small-matmul kernel on XLA:CPU (``torch_tpu.ops.batched_matmul``)
against CPU torch's ``bmm`` and XLA's own dot, back to back in one process: DLRM's interaction at
the anchor (batch 2048, 27 x 64 features), forward (``c @ c^T``) and the two backward products
(``g @ c``, ``g^T @ c``), fp32 or bf16. Each variant runs ``--rounds`` rounds of ``--calls``
calls, rounds interleaved so that load on a shared box hits all alike; the median round is
reported, as wall ms and as CPU ms of this process (steadier than wall time on a loaded box),
and the ratios torch / kernel.

    .venv/bin/python bench/bench_batched_matmul.py [--batch 2048] [--rows 27] [--dim 64] [--threads 2]
        [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import quiet_box
import torch

from torch_tpu.ops.batched_matmul import batched_matmul, kernel_available
from torch_tpu.runtime._jax import jax, jnp


def variants(batch: int, rows: int, dim: int, bf16: bool) -> dict[str, dict[str, Callable[[], object]]]:
    """{product: {"torch" | "kernel" | "xla dot": a call}} over the same operands."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(0)
    c = torch.randn(batch, rows, dim, generator=g).to(dtype)
    grad = torch.randn(batch, rows, rows, generator=g).to(dtype)
    jdtype = jnp.bfloat16 if bf16 else jnp.float32
    jc, jgrad = (jnp.asarray(t.float().numpy()).astype(jdtype) for t in (c, grad))
    kernel = {"forward": jax.jit(lambda x: batched_matmul(x, x, False, True)),
              "backward": jax.jit(lambda gr, x: (batched_matmul(gr, x), batched_matmul(gr, x, True, False)))}
    dot = {"forward": jax.jit(lambda x: x @ jnp.swapaxes(x, 1, 2)),
           "backward": jax.jit(lambda gr, x: (gr @ x, jnp.swapaxes(gr, 1, 2) @ x))}
    return {
        "forward": {"torch": lambda: torch.bmm(c, c.transpose(1, 2)),
                    "kernel": lambda: jax.block_until_ready(kernel["forward"](jc)),
                    "xla dot": lambda: jax.block_until_ready(dot["forward"](jc))},
        "backward": {"torch": lambda: (torch.bmm(grad, c), torch.bmm(grad.transpose(1, 2), c)),
                     "kernel": lambda: jax.block_until_ready(kernel["backward"](jgrad, jc)),
                     "xla dot": lambda: jax.block_until_ready(dot["backward"](jgrad, jc))},
    }


def time_round(call: Callable[[], object], calls: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) per call."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    return (time.perf_counter() - wall) / calls * 1e3, (time.process_time() - cpu) / calls * 1e3


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=27, help="features per sample (26 sparse + 1 dense)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (XLA:CPU keeps its pool)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if min(args.batch, args.rows, args.dim, args.threads, args.calls, args.rounds) < 1:
        parser.error("every size and count must be >= 1")
    if not kernel_available():
        parser.error("the kernel is not available here (no C++ compiler?): nothing to compare")
    torch.set_num_threads(args.threads)
    flop = 2 * args.batch * args.rows * args.rows * args.dim
    print(f"batched {args.rows}x{args.dim} products, batch {args.batch}, {args.precision}, torch threads "
          f"{args.threads}; load {os.getloadavg()[0]:.2f} (shared box: read the ratios)")
    for product, calls in variants(args.batch, args.rows, args.dim, args.precision == "bf16").items():
        names = list(calls)
        for call in calls.values():
            call()  # compiles
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                rounds[name].append(time_round(calls[name], args.calls))
        wall = {n: statistics.median(w for w, _ in rounds[n]) for n in names}
        cpu = {n: statistics.median(c for _, c in rounds[n]) for n in names}
        n_products = 1 if product == "forward" else 2
        print(f"  {product}: " + ", ".join(f"{n} {wall[n]:.2f} ms ({cpu[n]:.2f} CPU ms, "
                                           f"{n_products * flop / wall[n] / 1e6:.0f} GFLOP/s)" for n in names))
        print(f"  {product}: torch / kernel {wall['torch'] / wall['kernel']:.2f}x wall, "
              f"{cpu['torch'] / cpu['kernel']:.2f}x CPU; xla dot / kernel {wall['xla dot'] / wall['kernel']:.2f}x wall")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    quiet_box.run(main)
