"""MLP train step (forward, BCE-with-logits, backward, Adam) on tpu-eager vs CPU eager, same run.

Prints milliseconds per step for CPU eager, tpu eager with the per-op jit cache (default) and
without it (``TORCH_TPU_OP_JIT=0`` behaviour), and the ratios to CPU. On this CPU-only box the "tpu"
device runs XLA:CPU, so the ratio measures dispatch overhead, not TPU speed. Timings on a shared
machine are noisy.
Usage: .venv/bin/python bench/bench_torch_tpu_mlp.py [--steps N] [--batch B] [--width W]
"""

from __future__ import annotations

import argparse
import copy
import time

import quiet_box
import torch
from tqdm import tqdm

import torch_tpu
from torch_tpu.eager import op_jit


def _step_time(model, opt, x, y, steps: int, label: str) -> float:
    def step():
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    for _ in range(6):  # compiles: per-op programs on the 2nd step, traced Adam scalars on the 4th
        step()
    start = time.perf_counter()
    for _ in tqdm(range(steps), desc=label, leave=False):
        loss = step()
    loss.item()  # waits for the device
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1),
    )
    x, y = torch.randn(args.batch, 64), torch.randint(0, 2, (args.batch,)).float()
    ms_cpu = _step_time(cpu, torch.optim.Adam(cpu.parameters(), foreach=True), x, y, args.steps, "cpu")
    torch_tpu.reset_metrics()
    ms = {}
    for jit in (False, True):
        op_jit.set_enabled(jit)
        tpu = copy.deepcopy(cpu).to("tpu")
        ms[jit] = _step_time(tpu, torch.optim.Adam(tpu.parameters(), foreach=True), x.to("tpu"), y.to("tpu"),
                             args.steps, f"tpu jit={jit}")
    fallbacks = sum(torch_tpu.fallback_counts().values())
    print(f"MLP {args.batch}x64 -> {args.width} -> {args.width} -> 1, Adam(foreach); ms/step")
    print(f"cpu eager {ms_cpu:.2f} | tpu eager {ms[True]:.2f} (tpu/cpu {ms[True] / ms_cpu:.2f}) | "
          f"tpu eager without op jit {ms[False]:.2f} (tpu/cpu {ms[False] / ms_cpu:.2f}) | CPU fallbacks {fallbacks}")
    print(f"op jit cache: {op_jit.stats()}")


if __name__ == "__main__":
    quiet_box.run(main)
