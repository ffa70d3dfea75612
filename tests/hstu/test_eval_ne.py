"""HSTU's evaluation reports, per task, the AUC and the normalized entropy TorchRec's
``torchrec.metrics.ne`` computes from the same predictions and labels."""

from __future__ import annotations

import pytest
import torch
from torchrec.metrics.ne import compute_cross_entropy, compute_ne

from pipelines.sequences import read_meta, window_path
from pipelines.sequences.reader import SequenceReader
from tests.hstu.datasets import sequence_dataset
from torchrec_tpu.hstu.attention import PADDED
from torchrec_tpu.hstu.config import preset
from torchrec_tpu.hstu.model import HSTU
from torchrec_tpu.hstu.train import evaluate


def test_eval_ne_per_task_equals_torchrecs(tmp_path):
    data = sequence_dataset(tmp_path / "seq", users=16, items=20, events_per_user=6, seed=2, max_history=4)
    meta = read_meta(data)
    config = preset("hstu", meta.item_rows, meta.action_rows, tasks=tuple(meta.tasks), kernel=PADDED, dim=8,
                    qk_dim=4, v_dim=4, head_hidden=8, max_seq_len=16)
    torch.manual_seed(0)
    model = HSTU(config)
    reader = SequenceReader(window_path(data, 1), 16, max_history=4, item_rows=config.item_rows,
                            action_rows=config.action_rows, max_seq_len=config.max_seq_len, tasks=config.tasks)
    result = evaluate(model, reader, torch.device("cpu"), "fp32")
    model.eval()
    with torch.no_grad():
        logits, labels = zip(*((model(b.features).double(), b.labels.double()) for b in reader))
    logits, labels = torch.cat(logits), torch.cat(labels)
    assert result.samples == labels.shape[0] and set(result.task_ne) == set(meta.tasks)
    for t, task in enumerate(config.tasks):
        y, ones = labels[:, t], torch.ones_like(labels[:, t])
        ce = compute_cross_entropy(y, torch.sigmoid(logits[:, t]), ones, eta=1e-12)
        expected = float(compute_ne(ce.sum(), ones.sum(), y.sum(), (1 - y).sum(), eta=1e-12))
        assert result.task_ne[task] == pytest.approx(expected, rel=1e-5), task
        assert f"eval/ne/{task}" in result.scalars("eval") and f"{task} {result.task_ne[task]:.4f}" in result.describe()
