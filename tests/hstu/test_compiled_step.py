"""HSTU's dense half as one compiled tpu program per step (``--dense-device tpu``, or ``auto`` where
it is faster): over a few steps it trains as the eager CPU step does (the reference: the same
model in CPU eager torch), for both STU variants; and
``--dense-device auto`` times both placements' whole steps and logs its choice."""

from __future__ import annotations

import re

import pytest
import torch
from torchrec import EmbeddingCollection

from sparsecore.backends import XLA
from tests.hstu.datasets import sequence_dataset
from torchrec_tpu.hstu.config import HSTUConfig
from torchrec_tpu.hstu.model import HSTU, table_configs
from torchrec_tpu.hstu.placement import random_batch
from torchrec_tpu.hstu.sharded import sharded_embeddings
from torchrec_tpu.hstu.train import hstu_training, optimizers, step_function, step_layout
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.engines import dense_calibration
from torchrec_tpu.train.engines.dense_placement import dense_device

ITEMS, USERS, HISTORY, CANDIDATES = 50, 4, 40, 3


def _trained(stu: str, device: str, batches: list, precision: str = "fp32") -> tuple[HSTU, list[float]]:
    """A small model of ``stu`` layers (no dropout: the program's random stream is not CPU torch's)
    trained on ``batches`` by the job's step for its stack on ``device``, its tables the job's
    sharded EC (xla backend, fused row-wise Adagrad in backward)."""
    config = TrainConfig.from_options(model="hstu", dense_device=device, precision=precision, dense_lr=0.01)
    hstu = HSTUConfig(item_rows=ITEMS, action_rows=2, dim=16, heads=2, qk_dim=8, v_dim=8, max_seq_len=64,
                      head_hidden=16, tasks=("a", "b"), stu=stu, dropout=0.0)
    layout = step_layout(config, DistEnv(0, 1, 1), dense_device(device))
    torch.manual_seed(0)
    tables = EmbeddingCollection(tables=table_configs(hstu), device=torch.device("cpu"))
    model = HSTU(hstu, sharded_embeddings(hstu, ec=tables, local_batch=USERS, backend=XLA),
                 dense_device=layout.dense_device)
    step = step_function(model, *optimizers(config, model), layout)
    return model, [float(step(batch)) for batch in batches]


@pytest.mark.slow
@pytest.mark.parametrize("stu", ["paper", "dlrmv3"])
def test_the_compiled_step_trains_as_the_eager_cpu_step(stu):
    # two padded shapes (the last batch has other lengths): the program is rebuilt for it
    batches = [random_batch(USERS, HISTORY, CANDIDATES, ITEMS, 2, 2, seed) for seed in range(3)]
    batches.append(random_batch(USERS + 2, HISTORY // 2, CANDIDATES, ITEMS, 2, 2, 7))
    eager, eager_losses = _trained(stu, "cpu", batches)
    compiled, compiled_losses = _trained(stu, "tpu", batches)
    assert compiled_losses == pytest.approx(eager_losses, abs=1e-5)
    for (name, want), got in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_bf16_compiled_step_stays_near_the_eager_cpu_step():
    """bf16 autocast: the tpu device's policy against CPU torch's, a loss within 1e-2 over the steps."""
    batches = [random_batch(USERS, HISTORY, CANDIDATES, ITEMS, 2, 2, seed) for seed in range(3)]
    _, eager = _trained("paper", "cpu", batches, "bf16")
    _, compiled = _trained("paper", "tpu", batches, "bf16")
    assert compiled == pytest.approx(eager, abs=1e-2)


@pytest.mark.slow
def test_auto_times_both_whole_steps_and_logs_its_choice(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dense_calibration, "BUSY_SHARE", 1.0)  # stored even beside other tests
    data = sequence_dataset(tmp_path / "seq", users=40, items=20, events_per_user=8, seed=2, max_history=6)
    config = TrainConfig.from_options(model="hstu", data=str(data), dense_device="auto", batch_size=8,
                                      log_dir=str(tmp_path / "tb"))
    with caplog.at_level("INFO"), hstu_training(config) as t:
        chosen = t.device.type
    lines = [r.getMessage() for r in caplog.records]
    verdict = [line for line in lines if line.startswith("--dense-device auto: the STU stack and heads on ")]
    layout = [line for line in lines if line.startswith("training layout: HSTU")]
    assert len(verdict) == 1 and len(layout) == 1, lines
    times = re.search(r"on (cpu|tpu): a step takes ([\d.]+) ms there, ([\d.]+) ms on (cpu|tpu)", verdict[0])
    assert times is not None and times.group(1) == chosen and float(times.group(2)) <= float(times.group(3))
    assert f"STU stack and heads on {chosen}" in layout[0]
    assert ("one compiled program per step" in layout[0]) == (chosen == "tpu")
    caplog.clear()
    with caplog.at_level("INFO"), hstu_training(config) as again:  # the stored verdict: no timing
        assert again.device.type == chosen
    assert not any("timing a training step" in r.getMessage() for r in caplog.records)
