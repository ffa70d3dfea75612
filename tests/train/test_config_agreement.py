"""The ranks' agreement on their training options, through a store shared by two rank threads (the
real two-process case is in tests/faults/test_rank_config_agreement.py): it needs no process group,
so ranks whose flags would make them join over different transports are told, not hung."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from torchrec_tpu.errors import CollectiveError
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.config_agreement import agree_on_config


def _agree(configs: list[TrainConfig], timeout_s: float = 30) -> list[BaseException | None]:
    """Each config's agreement on its own thread (rank), over one store; each rank's outcome."""
    store = dist.HashStore()
    outcomes: list[BaseException | None] = [None] * len(configs)

    def rank(index: int) -> None:
        try:
            agree_on_config(configs[index], store, index, 2, timeout_s)
        except BaseException as error:  # noqa: BLE001  (the outcome under test)
            outcomes[index] = error

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(configs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


def test_same_options_agree():
    config = TrainConfig.from_options(dense_device="tpu", batch_size=64)
    assert _agree([config, TrainConfig.from_options(**config.to_dict())]) == [None, None]


@pytest.mark.parametrize("option, values", [
    ("dense_device", ("tpu", "cpu")),
    ("batch_size", (64, 8192)),
    ("dense_arch", ("64,16", "32,16")),
])
def test_every_rank_names_the_differing_option(option, values):
    outcomes = _agree([TrainConfig.from_options(**{option: value}) for value in values])
    assert all(isinstance(o, ConfigError) for o in outcomes), outcomes
    assert str(outcomes[0]) == str(outcomes[1])
    flag = "--" + option.replace("_", "-")
    assert f"{flag} is {values[0]!r} on rank 0, {values[1]!r} on rank 1" in str(outcomes[0]), outcomes[0]


def test_a_rank_that_never_posts_is_named_after_the_timeout():
    started = time.monotonic()
    (outcome,) = _agree([TrainConfig.from_options()], timeout_s=1)
    assert time.monotonic() - started < 10
    assert isinstance(outcome, CollectiveError) and "rank 1 did not post its options" in str(outcome), outcome
