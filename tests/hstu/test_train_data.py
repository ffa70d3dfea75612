"""``torchrec-tpu train --model hstu`` and its data: a run resumed with another ``--batch-size``
trains each row of the window exactly once, as an uninterrupted run does (the position is kept in
rows); a label of 7.0 is refused in one line before training; a dataset whose item ids make a table
larger than the machine is refused before any table is allocated."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.sequences import window_path, write_sequences
from pipelines.sequences.reader import SequenceBatch, SequenceReader
from tests.hstu.datasets import sequence_dataset
from torchrec_tpu.cli import main
from torchrec_tpu.hstu.train import HSTUTraining, trained_rows
from torchrec_tpu.train.distributed import DistEnv


def _dataset(tmp_path: Path) -> Path:
    return sequence_dataset(tmp_path / "seq", users=40, items=20, events_per_user=8, seed=2, max_history=6)


def _train(run: Path, data: Path, *extra: str) -> int:
    return main(["train", "--model", "hstu", "--data", str(data), "--eval-batch-size", "256",
                 "--dense-device", "cpu", "--log-dir", str(run / "tb"), "--checkpoint-dir", str(run / "ckpt"),
                 "--no-progress", *extra])


@pytest.mark.slow
def test_a_resume_with_another_batch_size_trains_each_row_once_per_epoch(tmp_path, monkeypatch):
    data = _dataset(tmp_path)
    train_window = window_path(data, 0)
    rows_of: dict[int, tuple[SequenceBatch, list[int]]] = {}  # id(batch) -> (batch, its window rows)
    trained: list[int] = []
    batch, step = SequenceReader.batch, HSTUTraining.step

    def read(self, rows):
        out = batch(self, rows)
        if self.path == train_window:
            rows_of[id(out)] = out, [int(r) for r in rows]
        return out

    def train_step(self, one):
        trained.extend(rows_of[id(one)][1])
        return step(self, one)

    monkeypatch.setattr(SequenceReader, "batch", read)
    monkeypatch.setattr(HSTUTraining, "step", train_step)
    assert _train(tmp_path / "straight", data, "--batch-size", "16") == 0
    straight, trained[:] = list(trained), []
    assert _train(tmp_path / "split", data, "--batch-size", "16", "--max-steps", "3") == 0
    first, trained[:] = list(trained), []
    assert _train(tmp_path / "split", data, "--batch-size", "8", "--resume", str(tmp_path / "split" / "ckpt")) == 0
    rows = pq.read_metadata(train_window).num_rows
    assert Counter(straight) == {row: 2 for row in range(rows)}  # HSTU's 2 epochs: every row once per pass
    assert len(first) == 48 and first == straight[:48]
    assert first + trained == straight  # resumed at another batch size: the same rows, once, in the same order


def test_a_checkpoint_that_kept_batches_resumes_at_its_rows():
    env = DistEnv(rank=0, world_size=2, local_world_size=2)
    assert trained_rows({"batch": 3, "config": {"batch_size": 32}}, env, 4) == 48  # 3 batches of 16 rows per rank
    assert trained_rows({"batch": 3}, env, 4) == 12  # no config saved: batches of this run's 4 rows per rank
    assert trained_rows({"row": 40, "batch": 3}, env, 4) == 40


def test_a_label_of_7_is_refused_before_training(tmp_path, capsys):
    data = _dataset(tmp_path)
    table = pq.read_table(window_path(data, 0))
    labels = [list(r) for r in table.column("label_positive").to_pylist()]
    labels[2][0] = 7.0
    column = table.schema.get_field_index("label_positive")
    pq.write_table(table.set_column(column, "label_positive", pa.array(labels, pa.list_(pa.float32()))),
                   window_path(data, 0))
    assert _train(tmp_path, data, "--batch-size", "16") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"torchrec-tpu train: error: {window_path(data, 0)}: row 2, column label_positive: 7.0 is not "
                   "a label in [0, 1]"), err
    assert not (tmp_path / "ckpt").exists()


def test_an_item_table_larger_than_the_machine_is_refused_before_allocation(tmp_path, capsys):
    data = _dataset(tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "item_rows": 10**12}))
    assert _train(tmp_path, data, "--batch-size", "16") == 2
    err = capsys.readouterr().err.strip()
    need = (10**12 + meta["action_rows"]) * (64 * 4 + 4) / 1e9  # fp32 rows and row-wise Adagrad's one slot a row
    assert err.startswith(f"torchrec-tpu train: error: the embedding tables need {need:,.1f} GB of this host's memory "
                          "(2 tables x 64 fp32 with rowwise_adagrad state"), err
    assert "largest: item 1,000,000,000,000 rows (260,000.0 GB), action 2 rows (0.0 GB)" in err, err
    assert err.endswith("; the item table has the dataset's item_rows (meta.json: its largest item id + 1); rewrite "
                        "the dataset with `torchrec-tpu data sequences --max-item-rows` or remap its item ids"), err
    assert "\n" not in err and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("start", [0, 5, 13])
def test_a_pass_resumed_at_a_row_yields_the_rest_of_its_permutation(tmp_path, start):
    data = _dataset(tmp_path)
    reader = SequenceReader(window_path(data, 0), 4, max_history=6, shuffle_seed=3)
    whole = np.concatenate([b.labels.numpy() for b in reader.batches(epoch=1)])
    rest = np.concatenate([b.labels.numpy() for b in reader.batches(epoch=1, start=start)])
    per_row = SequenceReader(window_path(data, 0), 1, max_history=6, shuffle_seed=3)
    skipped = sum(b.labels.shape[0] for b in list(per_row.batches(epoch=1))[:start])
    np.testing.assert_array_equal(rest, whole[skipped:])
    with pytest.raises(ValueError, match=r"cannot resume at row 10000 of a pass of \d+ rows"):
        next(reader.batches(epoch=1, start=10_000))


def test_labels_follow_the_models_tasks_whatever_the_files_column_order(tmp_path):
    from pipelines.sequences import Events
    from torchrec_tpu.hstu.train import hstu_training
    from torchrec_tpu.train.config import TrainConfig

    n = 40
    user, item = np.repeat(np.arange(4), n // 4), np.arange(n) % 7
    like, listen = (item % 2).astype(np.float32), (item < 3).astype(np.float32)
    events = Events(user=user, item=item, action=np.zeros(n, np.int64), timestamp=np.arange(n) * 10,
                    labels={"listen": listen, "like": like}, action_rows=1, source="hand")
    data = tmp_path / "seq"
    write_sequences(events, data, windows=2, max_history=4, candidates=2)
    for window in (0, 1):  # the label columns in the other order
        table = pq.read_table(window_path(data, window))
        names = [c for c in table.column_names if not c.startswith("label_")] + ["label_like", "label_listen"]
        pq.write_table(table.select(names), window_path(data, window))
    config = TrainConfig.from_options(model="hstu", data=str(data), dense_device="cpu", batch_size=4,
                                      log_dir=str(tmp_path / "tb"))
    with hstu_training(config) as t:
        assert t.model.config.tasks == ("listen", "like")
        batch = t.train.batch(np.arange(5))
    file = pq.read_table(window_path(data, 0)).slice(0, 5)
    expected = [[a, b] for la, lb in zip(file.column("label_listen").to_pylist(), file.column("label_like").to_pylist())
                for a, b in zip(la, lb)]
    assert batch.labels.tolist() == expected
