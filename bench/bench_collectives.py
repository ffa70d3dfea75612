"""Allreduce and all_to_all bandwidth: ``tpu_dist``'s XLA and gloo transports vs plain gloo.

Two (or --world) ranks on loopback, spawned by ``launch_local``. For each message size it times
the same collective four ways in the same run: plain gloo on CPU tensors (the reference),
``tpu_dist`` on CPU tensors (process-group overhead alone), and ``tpu_dist`` on tpu tensors over
the XLA transport (jitted XLA collectives on the JAX arrays, no host staging) and over the gloo
transport (device->host->device staging). ``all_to_all`` passes no splits (equal chunks: one
collective); ``a2a_splits`` passes the same equal splits explicitly, so the XLA transport takes
its uneven path (one small split exchange, pad to the largest split, slice). It prints algorithm
bandwidth and the ratios xla/gloo-transport and xla/plain-gloo. On this CPU-only box "tpu" is
JAX on XLA:CPU (JAX's own gloo collectives carry the XLA transport) and the machine is shared,
so absolute numbers are noisy; read the ratios.

    .venv/bin/python bench/bench_collectives.py --sizes-kib 1 64 1024 16384 65536 --iters 5
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from torch_tpu.distributed.local_launch import launch_local

# (group, device): group "xla" is the default tpu_dist group, "tpu_gloo" a tpu_dist group pinned
# to the gloo transport, "gloo" a plain gloo group.
CONFIGS = (("gloo", "cpu"), ("xla", "cpu"), ("xla", "tpu"), ("tpu_gloo", "tpu"))
OPS = ("allreduce", "all_to_all", "a2a_splits")
REPEATS = 3


def _collective(op: str, group: dist.ProcessGroup | None, x: torch.Tensor, out: torch.Tensor) -> None:
    if op == "allreduce":
        dist.all_reduce(x, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, x, group=group)
    else:
        size = dist.get_world_size(group)
        splits = [x.shape[0] // size] * size
        dist.all_to_all_single(out, x, splits, splits, group=group)


def _sync(device: str) -> None:
    if device == "tpu":
        torch.tpu.synchronize()


def _time(op: str, group: dist.ProcessGroup | None, device: str, numel: int, iters: int) -> float:
    x = torch.randn(numel).to(device)
    out = torch.empty(numel, device=device)
    _collective(op, group, x, out)  # warm-up: connections, jit caches
    _sync(device)
    best = float("inf")
    for _ in range(REPEATS):  # best of a few: the box is shared, contention only adds time
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            _collective(op, group, x, out)
        _sync(device)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def _rank(
    rank: int, size: int, store: dist.Store, timeout: datetime.timedelta, sizes: list[int], iters: int
) -> list[tuple[str, int, str, str, float]]:
    import torch_tpu  # noqa: F401 -- the tpu device
    import torch_tpu.distributed as tpu_dist

    # The default group joins jax.distributed (XLA transport) before the device is first used.
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout)
    if tpu_dist.active_transport() != "xla":
        raise RuntimeError("the default tpu_dist group did not get the XLA transport")
    groups = {
        "xla": None,
        "tpu_gloo": dist.new_group(backend="tpu_dist", pg_options=tpu_dist.TransportOptions("gloo")),
        "gloo": dist.new_group(backend="gloo"),
    }
    jobs = [(op, n, g, d) for op in OPS for n in sizes for g, d in CONFIGS]
    rows = []
    for op, numel, group, device in tqdm(jobs, disable=rank != 0, desc="collectives"):
        seconds = _time(op, groups[group], device, numel, iters)
        rows.append((op, numel * 4, group, device, seconds))
    dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[1, 64, 1024, 16384, 65536])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    numels = [kib * 1024 // 4 for kib in args.sizes_kib]
    rows = launch_local(_rank, args.world, numels, args.iters, timeout_s=600)[0]
    seconds = {(op, nbytes, g, d): s for op, nbytes, g, d, s in rows}
    print(f"{args.world} ranks, float32, best of {REPEATS} x {args.iters} iters; algorithm "
          "bandwidth in GB/s (shared box: noisy, read the ratios)")
    print(f"{'op':<11}{'size':>10}{'gloo/cpu':>10}{'pg/cpu':>9}{'xla/tpu':>9}{'gloo-tr/tpu':>12}"
          f"{'xla/gloo-tr':>12}{'xla/gloo':>10}")
    for op in OPS:
        for nbytes in sorted({k[1] for k in seconds}):
            bw = {cfg: nbytes / seconds[(op, nbytes, *cfg)] / 1e9 for cfg in CONFIGS}
            gloo, pg_cpu, xla, staged = (bw[c] for c in CONFIGS)
            print(f"{op:<11}{nbytes // 1024:>8}Ki{gloo:>10.3g}{pg_cpu:>9.3g}{xla:>9.3g}"
                  f"{staged:>12.3g}{xla / staged:>12.2f}{xla / gloo:>10.2f}")


if __name__ == "__main__":
    main()
