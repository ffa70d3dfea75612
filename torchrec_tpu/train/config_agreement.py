"""Every rank of a job must run the same training options: ranks launched with different flags
would train one model of inconsistent parts (rank 1's tables of another size than meta.json
says) and checkpoint it, or hang: flags that change a step's layout (``--dense-device``, the
engine, the model's shape, the batch size, ...) make the ranks issue different collectives, or
join the process group over different transports.

So the ranks agree through the rendezvous store before the process group forms, before any
collective: each posts its options (:meth:`TrainConfig.to_dict`, every option) and reads the
others'. When they differ every rank raises the same ConfigError naming each differing option with
each rank's value; a rank that never posts is a CollectiveError after the collective timeout.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch.distributed as dist

from torchrec_tpu.errors import CollectiveError
from torchrec_tpu.train.config import ConfigError, TrainConfig

_KEY = "torchrec_tpu/options/{}/{}"  # round, rank
_ROUNDS = "torchrec_tpu/options/rounds/{}"  # rank -> agreements so far (jobs may share a process group)


def agree_on_config(config: TrainConfig, store: dist.Store, rank: int, world_size: int,
                    timeout_s: float) -> None:
    """Return when every rank has ``config``'s options; else ConfigError (on every rank)."""
    round_ = store.add(_ROUNDS.format(rank), 1)
    options = config.to_dict()
    store.set(_KEY.format(round_, rank), _text(options))
    everyone = [json.loads(_posted(store, _KEY.format(round_, other), other, timeout_s))
                for other in range(world_size)]
    differing = [name for name in options if len({_text(o.get(name)) for o in everyone}) > 1]
    if not differing:
        return
    _all_have_read(store, _KEY.format(round_, "read"), world_size, timeout_s)
    raise ConfigError("the ranks were launched with different training options: "
                      + "; ".join(_by_value(name, everyone) for name in differing)
                      + " (give every rank the same flags and --config)")


def _posted(store: dist.Store, key: str, rank: int, timeout_s: float) -> bytes:
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:  # DistStoreError
        raise CollectiveError(f"the agreement on the training options at start timed out after {timeout_s:g} s: "
                              f"rank {rank} did not post its options (did it start?): {error}") from None
    return store.get(key)


def _all_have_read(store: dist.Store, key: str, world_size: int, timeout_s: float) -> None:
    """Wait until every rank has read the others' options before leaving: rank 0 may be the
    store's host, and its exit would cut the others off mid-read."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/done", "1")
    try:
        store.wait([f"{key}/done"], datetime.timedelta(seconds=timeout_s))
    except RuntimeError:
        pass  # a rank died meanwhile: each rank still reports the same differing options


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _by_value(name: str, everyone: list[dict[str, Any]]) -> str:
    """``--num-embeddings is 1000 on rank 0, 500 on rank 1``: ranks grouped by their value."""
    ranks: dict[str, list[int]] = {}
    for rank, options in enumerate(everyone):
        ranks.setdefault(repr(options.get(name)), []).append(rank)
    values = ", ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}"
                       for value, r in ranks.items())
    return f"--{name.replace('_', '-')} is {values}"
