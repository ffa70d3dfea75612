"""Allreduce and all_to_all bandwidth: ``tpu_dist``'s XLA and gloo transports vs plain gloo.

Two (or --world) ranks on loopback, spawned by ``launch_local``. For each message size it times
the same collective five ways in the same run: plain gloo on CPU tensors (the reference),
``tpu_dist`` on CPU tensors (process-group overhead alone), and ``tpu_dist`` on tpu tensors over
the XLA transport (jitted XLA collectives on the JAX arrays, no host staging) and over the gloo
transport (device->host->device staging). ``all_to_all`` passes no splits (equal chunks: one
collective); ``a2a_splits`` passes the same equal splits explicitly, so the XLA transport takes
its uneven path (one small split exchange, pad to the largest split, slice). The fifth, "jax", is
the collective as a raw jitted ``shard_map`` program on a prebuilt global array, no torch at all:
what JAX's own collectives reach, the limit for the XLA transport. It prints algorithm bandwidth
and the ratios xla/gloo-transport, xla/plain-gloo, jax/plain-gloo and xla/jax. On this CPU-only box "tpu" is
JAX on XLA:CPU (JAX's own gloo collectives carry the XLA transport) and the machine is shared,
so absolute numbers are noisy; read the ratios.

    .venv/bin/python bench/bench_collectives.py --sizes-kib 1 64 1024 16384 65536 --iters 20
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Callable

import quiet_box
import torch
import torch.distributed as dist
from tqdm import tqdm

from torch_tpu.distributed.local_launch import launch_local

# (group, device): group "xla" is the default tpu_dist group, "tpu_gloo" a tpu_dist group pinned
# to the gloo transport, "gloo" a plain gloo group; "jax" is no group at all: the same collective as
# a jitted shard_map program called on a prebuilt global JAX array (JAX's own cost, the limit).
CONFIGS = (("gloo", "cpu"), ("xla", "cpu"), ("xla", "tpu"), ("tpu_gloo", "tpu"), ("jax", "tpu"))
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


def _jax_collective(op: str, numel: int) -> Callable[[], None]:
    """One call of ``op`` as a raw JAX program over every process's device (no torch, no group);
    ``a2a_splits`` is timed as the equal all_to_all it amounts to."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("r",))
    body = (lambda x: lax.psum(x, "r")) if op == "allreduce" else (lambda x: lax.all_to_all(x, "r", 0, 0, tiled=True))
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("r"), out_specs=PartitionSpec("r")))
    local = jax.device_put(np.random.randn(numel).astype(np.float32), jax.local_devices()[0])
    x = jax.make_array_from_single_device_arrays((mesh.size * numel,), NamedSharding(mesh, PartitionSpec("r")),
                                                 [local])
    return lambda: program(x).addressable_data(0).block_until_ready()


def _time(op: str, group: dist.ProcessGroup | None, device: str, numel: int, iters: int, raw_jax: bool) -> float:
    if raw_jax:
        call = _jax_collective(op, numel)
    else:
        x = torch.randn(numel).to(device)
        out = torch.empty(numel, device=device)

        def call() -> None:
            _collective(op, group, x, out)
            _sync(device)
    call()  # warm-up: connections, jit caches
    best = float("inf")
    for _ in range(REPEATS):  # best of a few: the box is shared, contention only adds time
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            call()
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
        "jax": None,
    }
    jobs = [(op, n, g, d) for op in OPS for n in sizes for g, d in CONFIGS]
    rows = []
    for op, numel, group, device in tqdm(jobs, disable=rank != 0, desc="collectives"):
        seconds = _time(op, groups[group], device, numel, iters, raw_jax=group == "jax")
        rows.append((op, numel * 4, group, device, seconds))
    dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[1, 64, 1024, 16384, 65536])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    numels = [kib * 1024 // 4 for kib in args.sizes_kib]
    rows = launch_local(_rank, args.world, numels, args.iters, timeout_s=600)[0]
    seconds = {(op, nbytes, g, d): s for op, nbytes, g, d, s in rows}
    print(f"{args.world} ranks, float32, best of {REPEATS} x {args.iters} iters; algorithm "
          "bandwidth in GB/s (shared box: noisy, read the ratios)")
    print(f"{'op':<11}{'size':>10}{'gloo/cpu':>10}{'pg/cpu':>9}{'xla/tpu':>9}{'gloo-tr/tpu':>12}{'jax':>9}"
          f"{'xla/gloo-tr':>12}{'xla/gloo':>10}{'jax/gloo':>10}{'xla/jax':>9}")
    for op in OPS:
        for nbytes in sorted({k[1] for k in seconds}):
            bw = {cfg: nbytes / seconds[(op, nbytes, *cfg)] / 1e9 for cfg in CONFIGS}
            gloo, pg_cpu, xla, staged, raw = (bw[c] for c in CONFIGS)
            print(f"{op:<11}{nbytes // 1024:>8}Ki{gloo:>10.3g}{pg_cpu:>9.3g}{xla:>9.3g}{staged:>12.3g}{raw:>9.3g}"
                  f"{xla / staged:>12.2f}{xla / gloo:>10.2f}{raw / gloo:>10.2f}{xla / raw:>9.2f}")
    print("xla/gloo: the target (>= 1.0); jax/gloo: what JAX's own collectives reach here (the limit of an "
          "XLA transport on XLA:CPU); xla/jax: the share of it the transport keeps")


if __name__ == "__main__":
    quiet_box.run(main)
