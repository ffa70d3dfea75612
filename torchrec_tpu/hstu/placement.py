"""``--dense-device auto`` for HSTU on XLA:CPU at one rank: where the STU stack and heads train
faster, decided from whole training steps as DLRM's towers are
(:mod:`torchrec_tpu.train.engines.dense_calibration`: both placements timed by turns, the fastest
round of each, the verdict stored under a key of the model, batch and host). Each placement's step
is the job's own (its tables' engine and backend, optimizers, precision; the tpu one the compiled
program), over its tables capped at :data:`~torchrec_tpu.train.engines.dense_calibration.TABLE_ROWS_CAP`
rows, on random batches of the job's per-rank users, history length and candidates.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.sequences.layout import SequenceMeta
from pipelines.sequences.reader import SequenceBatch
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.engines.dense_calibration import TABLE_ROWS_CAP, measured_device, placement_key, timed_rounds

_BATCHES = 2  # random batches the steps cycle through


def random_batch(users: int, history: int, candidates: int, items: int, actions: int, tasks: int,
                 seed: int) -> SequenceBatch:
    """``users`` random users of ``history // 2`` to ``history`` events and ``candidates``
    candidates each, ids below ``items`` / ``actions``, rising timestamps, 0/1 labels per task; the
    lengths are the same for every ``seed`` (one padded shape: one step program)."""
    hist = torch.randint(max(1, history // 2), history + 1, (users,), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    cand = torch.full((users,), candidates)
    n, c = int(hist.sum()), int(cand.sum())
    values = {"item": torch.randint(0, items, (n,), generator=gen),
              "action": torch.randint(0, actions, (n,), generator=gen),
              "timestamp": torch.randint(0, 60, (n,), generator=gen).cumsum(0),
              "candidate_item": torch.randint(0, items, (c,), generator=gen),
              "candidate_timestamp": torch.full((c,), 10**6)}
    lengths = {"item": hist, "action": hist, "timestamp": hist, "candidate_item": cand, "candidate_timestamp": cand}
    kjt = KeyedJaggedTensor(keys=list(values), values=torch.cat(list(values.values())),
                            lengths=torch.cat([lengths[k] for k in values]))
    return SequenceBatch(kjt, torch.randint(0, 2, (c, tasks), generator=gen).float())


def measured_stack_device(config: TrainConfig, env: DistEnv, meta: SequenceMeta, history: int, local_batch: int,
                          build_step: Callable[[str, SequenceMeta], Callable[[SequenceBatch], torch.Tensor]]) -> str:
    """"cpu" or "tpu": where the job's step (``build_step(device, meta)``: the job's model for the
    dataset ``meta``, its stack and heads on ``device``, and its step function) trains faster at
    ``local_batch`` users per step of ``history`` events at most, on this host (stored; timed once)."""
    capped = dataclasses.replace(meta, item_rows=min(meta.item_rows, TABLE_ROWS_CAP))
    key = placement_key("hstu", config.model.kind, config.model.stu, capped.item_rows, capped.action_rows,
                        capped.tasks, capped.candidates, history, local_batch, config.engine.kind,
                        config.engine.sparse_backend, config.optim.precision, env.world_size)

    def time_both():
        batches = [random_batch(local_batch, history, capped.candidates, capped.item_rows, capped.action_rows,
                                len(capped.tasks), seed) for seed in range(_BATCHES)]
        with torch.random.fork_rng():  # the job's own models are built from its seed afterwards
            return timed_rounds({name: map(build_step(name, capped), itertools.cycle(batches))
                                 for name in ("cpu", "tpu")})

    return measured_device(key, "the STU stack and heads", time_both)
