"""Graph mode benchmark, all variants measured in the same run.

1. DLRM dense tower forward+backward step (BCE, SGD): torch.compile(backend="tpu") on tpu tensors
   vs tpu strict eager vs torch CPU eager vs torch CPU inductor.
2. An elementwise-heavy block on tpu tensors: defer_and_fuse vs strict eager.

Prints ms per step and ratios against CPU eager (1) / strict (2). The "tpu" device runs on XLA:CPU
here, so ratios measure dispatch and fusion, not TPU speed; on a shared 2-core box they are noisy.
Usage: .venv/bin/python bench/bench_compile.py [--steps N] [--batch B] [--skip-inductor]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import quiet_box
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch_tpu  # noqa: E402
import torch_tpu.compile  # noqa: E402,F401
from tests.torch_tpu.compile.models import DLRMDense  # noqa: E402


def _ms_per_call(fn: Callable[[], torch.Tensor], steps: int, label: str) -> float:
    for _ in range(3):  # warm-up and compile
        fn().cpu()
    start = time.perf_counter()
    for _ in tqdm(range(steps), desc=label, leave=False):
        fn().cpu()  # a host read every step, like logging the loss: each step is one fused graph
    return (time.perf_counter() - start) / steps * 1e3


def _dlrm_step(model: torch.nn.Module, device: str, batch: int,
               compile_backend: str | None) -> Callable[[], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(batch, 13, generator=gen).to(device)
    pooled = torch.randn(batch, 4, 16, generator=gen).to(device)
    labels = torch.rand(batch, generator=gen).round().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(model(dense, pooled), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if compile_backend is None:
        return step
    return torch.compile(step, backend=compile_backend, dynamic=False)


def _elementwise_block(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = torch.tanh(x * y + 0.5) - torch.sigmoid(x) * 0.25
        x = x * torch.rsqrt(x.square() + 1.0) + y.abs().sqrt()
    return x.sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--skip-inductor", action="store_true", help="inductor's first compile takes ~1 min here")
    args = parser.parse_args()

    torch.manual_seed(0)
    base = DLRMDense()
    variants = {
        "torch CPU eager": (copy.deepcopy(base), "cpu", None),
        "tpu strict eager": (copy.deepcopy(base).to("tpu"), "tpu", None),
        "tpu torch.compile": (copy.deepcopy(base).to("tpu"), "tpu", "tpu"),
    }
    if not args.skip_inductor:
        variants["torch CPU inductor"] = (copy.deepcopy(base), "cpu", "inductor")
    times = {
        name: _ms_per_call(_dlrm_step(model, device, args.batch, backend), args.steps, name)
        for name, (model, device, backend) in variants.items()
    }
    ref = times["torch CPU eager"]
    print(f"DLRM dense tower fwd+bwd+SGD step, batch {args.batch} (ms/step; ratio = CPU eager / variant):")
    for name, ms in times.items():
        print(f"  {name:22s} {ms:8.3f} ms   x{ref / ms:6.2f}")

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 512, generator=gen).to("tpu")
    y = torch.randn(512, 512, generator=gen).to("tpu")
    strict = _ms_per_call(lambda: _elementwise_block(x, y), args.steps, "strict")
    with torch_tpu.eager_mode("defer_and_fuse"):
        fused = _ms_per_call(lambda: _elementwise_block(x, y), args.steps, "defer_and_fuse")
    print("Elementwise block (33 ops on 512x512) on tpu tensors:")
    print(f"  strict eager           {strict:8.3f} ms")
    print(f"  defer_and_fuse         {fused:8.3f} ms   x{strict / fused:6.2f} vs strict")


if __name__ == "__main__":
    quiet_box.run(main)
