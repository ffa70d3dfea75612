"""``--dense-device auto`` on XLA:CPU, decided by measurement: the dense towers' training step
(forward, backward, dense optimizer) timed on this host both ways, CPU eager torch and the tpu
device's one compiled program, at the job's per-rank batch; the faster wins.

Which wins depends on the host (its cores, their vector units, what else runs on them), the torch
thread count, the towers' sizes and the device's kernels, not on a fixed size threshold. The
verdict (with both times) is stored in the compile cache (level ``placements``) under a key of
everything it depends on, so a later job with the same towers on this host decides without
timing; the tpu step's program is stored in the step cache as usual, so a stored verdict or a
second measurement compiles nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import xla_cache
from torchrec_tpu.train.model import ModelSpec, build_dlrm

_log = logging.getLogger(__name__)
LEVEL = "placements"
_WARMUP_STEPS, _STEPS, _ROUNDS = 2, 3, 3


@dataclass(frozen=True)
class PlacementTiming:
    """Median milliseconds per dense step of each placement."""

    cpu_ms: float
    tpu_ms: float

    @property
    def device(self) -> str:
        """The faster placement ("cpu" on a tie: no device, no compile)."""
        return "tpu" if self.tpu_ms < self.cpu_ms else "cpu"


def measured_dense_device(spec: ModelSpec, batch_size: int, optimizer: type[torch.optim.Optimizer],
                          precision: str = "fp32") -> str:
    """"cpu" or "tpu": where ``spec``'s towers train faster at ``batch_size`` samples per step with
    ``optimizer`` at ``precision``, on this host (stored verdict, else :func:`time_placements`,
    then stored)."""
    key = _key(spec, batch_size, optimizer, precision)
    stored = xla_cache.load(LEVEL, key, lambda blob: json.loads(blob.decode()))
    if stored is not None:
        return str(stored["device"])
    timing = time_placements(spec, batch_size, optimizer, precision)
    _log.info("--dense-device auto: towers' step %.1f ms in CPU eager torch, %.1f ms as one tpu program (XLA:CPU); "
              "picked %s", timing.cpu_ms, timing.tpu_ms, timing.device)
    xla_cache.store(LEVEL, key, json.dumps({"device": timing.device, "cpu_ms": timing.cpu_ms,
                                            "tpu_ms": timing.tpu_ms}).encode())
    return timing.device


def time_placements(spec: ModelSpec, batch_size: int, optimizer: type[torch.optim.Optimizer],
                    precision: str = "fp32") -> PlacementTiming:
    """Both placements' median ms per step of the towers (random batches), rounds interleaved so
    that load on a shared host hits both alike."""
    import torch_tpu.compile as tc
    from torchrec_tpu.train.engines.dense_step import DLRMDenseLoss

    tiny = dataclasses.replace(spec, table_sizes=(1,) * len(spec.feature_names))  # the tables stay out
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cpu_model = DLRMDenseLoss(build_dlrm(tiny, dense_device=torch.device("cpu")), precision)
        batches = [(torch.randn(batch_size, spec.dense_in_features),
                    torch.randn(batch_size, len(spec.feature_names), spec.embedding_dim),
                    torch.randint(0, 2, (batch_size,)).float()) for _ in range(2)]
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    cpu_opt = optimizer(cpu_model.parameters(), lr=0.01)
    tpu_step = tc.train_step(tpu_model, optimizer(tpu_model.parameters(), lr=0.01, foreach=True))
    tpu_batches = [tuple(t.to("tpu") for t in batch) for batch in batches]

    def cpu_steps(n: int) -> None:
        for i in range(n):
            cpu_opt.zero_grad()
            cpu_model(*batches[i % 2]).backward()
            cpu_opt.step()

    def tpu_steps(n: int) -> None:
        for i in range(n):
            loss = tpu_step(*tpu_batches[i % 2])
        float(loss)  # steps dispatch asynchronously: wait for the last

    runs: dict[str, Callable[[int], None]] = {"cpu": cpu_steps, "tpu": tpu_steps}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run(_WARMUP_STEPS)  # the tpu step compiles (or loads) here
    for r in range(_ROUNDS):
        for name in (("cpu", "tpu") if r % 2 == 0 else ("tpu", "cpu")):
            start = time.perf_counter()
            runs[name](_STEPS)
            times[name].append((time.perf_counter() - start) / _STEPS * 1e3)
    return PlacementTiming(statistics.median(times["cpu"]), statistics.median(times["tpu"]))


def _key(spec: ModelSpec, batch_size: int, optimizer: type[torch.optim.Optimizer], precision: str) -> str:
    """Everything the verdict depends on: the towers, batch, optimizer, precision, torch threads,
    this host's CPU and core count, the library versions and the device's kernels."""
    import jax

    from torch_tpu.ops import batched_matmul

    towers = (len(spec.feature_names), spec.embedding_dim, spec.dense_in_features, spec.dense_layers,
              spec.over_layers, spec.dcn_num_layers, spec.dcn_low_rank_dim)
    parts = (towers, batch_size, optimizer.__qualname__, precision, torch.get_num_threads(), os.cpu_count(),
             _cpu_model(), platform.machine(), torch.__version__, jax.__version__, batched_matmul.fingerprint())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
