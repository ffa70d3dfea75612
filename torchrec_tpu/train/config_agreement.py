"""Every rank of a job must run the same training options: ranks launched with different flags
would train one model of inconsistent parts (rank 1's tables of another size than meta.json
says) and checkpoint it. At start the ranks exchange one hash of their options (an all_gather of
a short string); only when the hashes differ do they exchange the options themselves, and every
rank raises the same ConfigError naming each differing option with each rank's value.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist

from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.rank_watch import collectives


def agree_on_config(config: TrainConfig, env: DistEnv) -> None:
    """Return when every rank has ``config``'s options; else ConfigError (on every rank)."""
    if env.world_size == 1:
        return
    options = config.to_dict()
    with collectives("the agreement on the training options at start (an all_gather)"):
        digests = _gathered(_digest(options), env)
        if len(set(digests)) == 1:
            return
        everyone = _gathered(options, env)
    differing = [name for name in options if len({_text(o.get(name)) for o in everyone}) > 1]
    raise ConfigError("the ranks were launched with different training options: "
                      + "; ".join(_by_value(name, everyone) for name in differing)
                      + " (give every rank the same flags and --config)")


def _digest(options: dict[str, Any]) -> str:
    return hashlib.sha256(_text(options).encode()).hexdigest()


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _gathered(value: Any, env: DistEnv) -> list[Any]:
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, value)
    return out


def _by_value(name: str, everyone: list[dict[str, Any]]) -> str:
    """``--num-embeddings is 1000 on rank 0, 500 on rank 1``: ranks grouped by their value."""
    ranks: dict[str, list[int]] = {}
    for rank, options in enumerate(everyone):
        ranks.setdefault(repr(options.get(name)), []).append(rank)
    values = ", ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}"
                       for value, r in ranks.items())
    return f"--{name.replace('_', '-')} is {values}"
