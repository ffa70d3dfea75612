"""Sparsecore EBC checkpoint save / load: per-rank shards (each rank writes and reads only the rows
and columns it holds) vs the gathered approach it replaced (every rank all-gathers the full tables
and slots, DCP writes them once; on load every rank reads the full tables and slices its part).

Each approach runs in fresh ranks (loopback processes, gloo), so one's memory high-water mark does
not hide the other's. Peak memory is the growth of the process's peak RSS (VmHWM, reset before
each phase) over its RSS when the phase starts, worst rank. Timings on a shared 2-core box are
noisy: read the ratios.

    .venv/bin/python bench/bench_checkpoint.py [--world 2] [--tables 4] [--rows 250000] [--dim 32]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Callable

import quiet_box
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from sparsecore.optimizers import Adagrad
from sparsecore.specs import FeatureSpec, TableSpec
from torch_tpu.distributed import launch_local
from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding
from xla_cache import host_heap

APPROACHES = ("sharded", "gathered")


def _ebc(args: argparse.Namespace) -> ShardedSparseCoreEBC:
    tables = [TableSpec(f"t{i}", args.rows, args.dim, optimizer=Adagrad(0.1)) for i in range(args.tables)]
    features = [FeatureSpec(f"f{i}", f"t{i}", 8) for i in range(args.tables)]
    ranks = tuple(range(args.world)) if args.sharding == "column_wise" else ()
    return ShardedSparseCoreEBC(tables, features, {t.name: TableSharding(args.sharding, ranks) for t in tables})


def _mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _measure(phase: Callable[[], None]) -> tuple[float, float]:
    """(seconds over all ranks, MiB of peak RSS growth on this rank) of the collective ``phase``."""
    gc.collect()
    host_heap.release()  # hand freed memory back, or the next phase reuses it unseen
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    dist.barrier()
    before, start = _mib("VmRSS"), time.perf_counter()
    phase()
    dist.barrier()
    return time.perf_counter() - start, _mib("VmHWM") - before


def _save_load_sharded(ebc: ShardedSparseCoreEBC, path: str) -> tuple[Callable[[], None], Callable[[], None]]:
    def save() -> None:
        dcp.save({"ebc": ebc.state_dict()}, checkpoint_id=path)

    def load() -> None:
        state = {"ebc": ebc.state_dict()}
        dcp.load(state, checkpoint_id=path)
        ebc.load_state_dict(state["ebc"])
    return save, load


def _save_load_gathered(ebc: ShardedSparseCoreEBC, path: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """What the EBC's state was before per-rank shards: the unsharded tables, identical on every
    rank; a load reads them whole and keeps this rank's slices."""
    def save() -> None:
        dcp.save({"weights": ebc.unsharded_weights(), "slots": ebc.unsharded_slots()}, checkpoint_id=path)

    def load() -> None:
        full = {name: torch.empty(spec.vocab_size, spec.dim) for name, spec in ebc.tables.items()}
        state = {"weights": full, "slots": {name: {"accumulator": torch.empty_like(w)} for name, w in full.items()}}
        dcp.load(state, checkpoint_id=path)
        mine = {s.table: s for _, s in ebc._served[ebc.rank]}
        ebc._backend.load_state({n: s.slice(state["weights"][n]) for n, s in mine.items()},
                                {n: {k: s.slice(v) for k, v in state["slots"][n].items()} for n, s in mine.items()},
                                ebc.steps)
    return save, load


def rank_body(rank: int, world_size: int, store, timeout, approach: str, args: argparse.Namespace,
              directory: str) -> dict[str, float]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        ebc = _ebc(args)
        expected = ebc._backend.table_weights()
        make = _save_load_sharded if approach == "sharded" else _save_load_gathered
        save, load = make(ebc, f"{directory}/{approach}")
        save_s, save_mib = _measure(save)
        load_s, load_mib = _measure(load)
        got = ebc._backend.table_weights()
        assert all(torch.equal(got[name], w) for name, w in expected.items()), "load changed the tables"
        written = sum(p.stat().st_size for p in Path(directory, approach).glob(f"__{rank}_*.distcp"))
        return {"save_s": save_s, "load_s": load_s, "save_mib": save_mib, "load_mib": load_mib,
                "written_mib": written / 2**20}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--sharding", choices=("row_wise", "column_wise"), default="row_wise",
                        help="every table's sharding (column_wise: one column block per rank)")
    args = parser.parse_args()
    state_mib = 2 * args.tables * args.rows * args.dim * 4 / 2**20  # weights + Adagrad accumulators
    print(f"{args.tables} tables x {args.rows:,} rows x dim {args.dim}, Adagrad, {args.sharding} over "
          f"{args.world} ranks: {state_mib:,.0f} MiB of tables + slots ({state_mib / args.world:,.0f} MiB per rank)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as directory:
        for approach in APPROACHES:
            per_rank = launch_local(rank_body, args.world, approach, args, directory, timeout_s=1200)
            results[approach] = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    print(f"{'':>10} {'save s':>8} {'load s':>8} {'save peak MiB':>14} {'load peak MiB':>14} {'written MiB/rank':>17}")
    for approach, r in results.items():
        print(f"{approach:>10} {r['save_s']:8.2f} {r['load_s']:8.2f} {r['save_mib']:14.0f} {r['load_mib']:14.0f} "
              f"{r['written_mib']:17.0f}")
    s, g = results["sharded"], results["gathered"]
    print(f"gathered / sharded: save time {g['save_s'] / s['save_s']:.2f}x, "
          f"load time {g['load_s'] / s['load_s']:.2f}x, "
          f"save peak memory {g['save_mib'] / max(s['save_mib'], 1):.2f}x, "
          f"load peak memory {g['load_mib'] / max(s['load_mib'], 1):.2f}x (worst rank)")


if __name__ == "__main__":
    quiet_box.run(main)
