"""DLRMv4 at MLPerf's shape on this host: ``train --model dlrmv4``'s model and step at sequence 4,096.

MLPerf's dims (11 tables of dim 512, capped at ``--max-rows``; 3 STU layers, 4 heads, 128/128), each
user's sequence as full as MLPerf's (yambda_5b.gin: 8 contextual tokens, 4,086 history events, the
candidate); ``--batch`` users a step, set up and stepped as ``train`` does (the tables sharded by
TorchRec's planner with their fused RowWiseAdagrad, Adam with clipping, bf16 forward). The
attention goes through the jagged op, so no ``[B, H, L, L]`` tensor is made. Printed: the steady
steps/s and samples/s (after the first step, which compiles), the peak RSS, its growth over the
built model, and that growth as a share of one fp32 ``[B, H, L, L]`` score tensor (the padded
attention keeps several).
Usage: .venv/bin/python bench/bench_dlrmv4.py [--batch 2] [--steps 4] [--max-rows 131072] [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import quiet_box

import torch_tpu  # noqa: F401  (the tpu device)
from pipelines.sequences.dlrmv4 import DLRMv4Synthetic
from torchrec_tpu.hstu.dlrmv4 import DLRMv4Config
from torchrec_tpu.hstu.dlrmv4_recipe import HISTORY_LENGTH
from torchrec_tpu.hstu.dlrmv4_training import dlrmv4_training
from torchrec_tpu.train.config import TrainConfig


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2, help="users a step")
    parser.add_argument("--steps", type=int, default=4, help="steps timed after the first")
    parser.add_argument("--max-rows", type=int, default=DLRMv4Config().max_rows, help="each table's rows at most")
    parser.add_argument("--seq-len", type=int, default=4096, help="max_seq_len; every history fills it")
    args = parser.parse_args()
    config = DLRMv4Config(max_seq_len=args.seq_len, max_rows=args.max_rows)
    history = min(HISTORY_LENGTH, config.max_history)
    print(f"DLRMv4 at sequence {config.max_seq_len} ({history} history events + 8 contextual + 1 candidate), dim "
          f"{config.dim}, {config.layers} layers, tables of {config.max_rows:,} rows at most, batch {args.batch}, "
          "bf16 forward")
    options = TrainConfig.from_options(model="dlrmv4", batch_size=args.batch, dense_lr=1e-4, sparse_lr=1e-4,
                                       precision="bf16", limit_train_batches=args.steps + 1, seed=0)
    world = DLRMv4Synthetic(min_history=history, max_history=history)
    with dlrmv4_training(options, config, world) as training:
        batches = iter(training.train)
        before = peak_rss_mib()
        start = time.perf_counter()
        loss = training.step(next(batches))
        first = time.perf_counter() - start
        start = time.perf_counter()
        for batch in batches:
            loss = training.step(batch)
        steady = (time.perf_counter() - start) / args.steps
    peak = peak_rss_mib()
    scores = args.batch * config.heads * config.max_seq_len ** 2 * 4 / 2 ** 20
    print(f"first step {first:.1f} s; steady {1 / steady:.3f} steps/s, {args.batch / steady:.2f} samples/s "
          f"(loss {float(loss):.4f})")
    print(f"peak RSS {peak:.0f} MiB (+{peak - before:.0f} over the built model); one fp32 [B, H, L, L] score "
          f"tensor: {scores:.0f} MiB; growth / that: {(peak - before) / scores:.2f}x")


if __name__ == "__main__":
    quiet_box.run(main)
