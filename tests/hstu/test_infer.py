"""``torchrec-tpu infer`` on an HSTU checkpoint: a row per candidate with its score per task, equal to
the trained model's scores computed by hand from the checkpoint's files, and an offline AUC equal to
the one ``train`` printed for the same window."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.sequences import synthetic_events, window_path, write_sequences
from pipelines.sequences.reader import SequenceReader
from torchrec_tpu.cli import main
from torchrec_tpu.hstu import HSTU, HSTUConfig


def _trained(tmp_path: Path, capsys: pytest.CaptureFixture) -> tuple[Path, Path, float]:
    data = tmp_path / "seq"
    write_sequences(synthetic_events(users=80, items=30, events_per_user=10, seed=4), data, windows=2,
                    max_history=8, candidates=2)
    assert main(["train", "--model", "hstu", "--data", str(data), "--batch-size", "16", "--max-steps", "4",
                 "--dense-device", "cpu", "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir",
                 str(tmp_path / "ckpt"), "--no-progress"]) == 0
    auc = float(re.search(r"AUC \(window T\+1, \d+ candidates\): positive (0\.\d{4})", capsys.readouterr().out)[1])
    return data, tmp_path / "ckpt", auc


def _scores_by_hand(checkpoint: Path, window: Path) -> np.ndarray:
    meta = json.loads((checkpoint / "meta.json").read_text())
    model = HSTU(HSTUConfig.from_dict(meta["hstu"]))
    state = {**torch.load(checkpoint / "dense-rank-000.pt", weights_only=False)["model"],
             **torch.load(checkpoint / "tables-rank-000.pt", weights_only=False)}
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    reader = SequenceReader(window, 1000, max_history=100)
    with torch.no_grad():
        return np.concatenate([torch.sigmoid(model.eval()(b.features)).numpy() for b in reader])


@pytest.mark.slow
def test_infer_scores_every_candidate_and_reports_trains_auc(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, root, train_auc = _trained(tmp_path, capsys)
    window = window_path(data, 1)
    assert main(["infer", "--data", str(window), "--checkpoint", str(root), "--output", str(tmp_path / "out"),
                 "--key-columns", "user", "--num-cpus", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    got = pa.concat_tables([pq.read_table(p) for p in parts]).sort_by([("row_id", "ascending"),
                                                                          ("candidate", "ascending")])
    assert got.column_names == ["user", "row_id", "candidate", "candidate_item", "label_positive",
                                "prediction_positive"]
    source = pq.read_table(window)
    assert got.num_rows == sum(len(x) for x in source.column("candidate_item").to_pylist())
    assert got.column("candidate_item").to_pylist() == [i for row in source.column("candidate_item").to_pylist()
                                                        for i in row]
    users = source.column("user").to_numpy()
    assert (got.column("user").to_numpy() == users[got.column("row_id").to_numpy()]).all()
    (saved,) = root.glob("step-*")
    np.testing.assert_allclose(got.column("prediction_positive").to_numpy(), _scores_by_hand(saved, window)[:, 0],
                               rtol=1e-5, atol=1e-6)
    infer_auc = float(re.search(r"AUC +(0\.\d{4}) \(offline: prediction_positive against label_positive, "
                                rf"{got.num_rows:,} rows", out)[1])
    assert infer_auc == pytest.approx(train_auc, abs=1.5e-4)


def test_a_checkpoint_of_two_ranks_is_refused_by_name(tmp_path: Path) -> None:
    from torchrec_tpu.hstu.inference import load_hstu_inference

    saved = tmp_path / "step-00000003"
    saved.mkdir()
    (saved / "meta.json").write_text(json.dumps({"world_size": 2, "step": 3, "hstu": {"item_rows": 5,
                                                                                          "action_rows": 2}}))
    with pytest.raises(ValueError, match="written by 2 ranks.*loads the checkpoints of one-rank runs"):
        load_hstu_inference(tmp_path)
