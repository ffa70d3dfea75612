"""Random HSTU batches for the tests."""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.hstu.model import FEATURE_KEYS


def batch_kjt(history, candidates, config, seed=5):
    """A random HSTU batch: users with ``history`` events and ``candidates`` candidates each."""
    gen = torch.Generator().manual_seed(seed)
    hist, cand = torch.tensor(history), torch.tensor(candidates)
    n, c = int(hist.sum()), int(cand.sum())
    values = {"item": torch.randint(0, config.item_rows, (n,), generator=gen),
              "action": torch.randint(0, config.action_rows, (n,), generator=gen),
              "timestamp": 1_000_000 + torch.randint(0, 5000, (n,), generator=gen).cumsum(0),
              "candidate_item": torch.randint(0, config.item_rows, (c,), generator=gen),
              "candidate_timestamp": 2_000_000 + torch.randint(0, 5000, (c,), generator=gen)}
    lengths = {"item": hist, "action": hist, "timestamp": hist, "candidate_item": cand, "candidate_timestamp": cand}
    return KeyedJaggedTensor(keys=list(FEATURE_KEYS), values=torch.cat([values[k] for k in FEATURE_KEYS]),
                             lengths=torch.cat([lengths[k] for k in FEATURE_KEYS]))
