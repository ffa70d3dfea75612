"""``torchrec-tpu infer`` on an HSTU checkpoint: a row per candidate with its score per task, equal to
the trained model's scores computed by hand from the checkpoint's files, and an offline AUC equal to
the one ``train`` printed for the same window, whether one rank or two wrote the checkpoint; the
checkpoints of one rank in the layout before DCP still load."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.sequences import window_path
from pipelines.sequences.reader import SequenceReader
from tests.hstu.checkpoints import saved_state
from tests.hstu.datasets import sequence_dataset
from torchrec_tpu.cli import main
from torchrec_tpu.hstu import HSTU, HSTUConfig


def _dataset(tmp_path: Path) -> Path:
    return sequence_dataset(tmp_path / "seq", users=80, items=30, events_per_user=10, seed=4, max_history=8)


TRAIN = ["train", "--model", "hstu", "--batch-size", "16", "--max-steps", "4", "--dense-device", "cpu",
         "--no-progress"]


def _train_auc(out: str) -> float:
    return float(re.search(r"AUC \(window T\+1, \d+ candidates\): positive (0\.\d{4})", out)[1])


def _trained(tmp_path: Path, capsys: pytest.CaptureFixture) -> tuple[Path, Path, float]:
    data = _dataset(tmp_path)
    assert main([*TRAIN, "--data", str(data), "--log-dir", str(tmp_path / "tb"), "--checkpoint-dir",
                 str(tmp_path / "ckpt")]) == 0
    return data, tmp_path / "ckpt", _train_auc(capsys.readouterr().out)


def _trained_on_two_ranks(tmp_path: Path) -> tuple[Path, Path, float]:
    data = _dataset(tmp_path)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "torchrec_tpu.cli", *TRAIN, "--data", str(data), "--log-dir", str(tmp_path / "tb"),
                           "--checkpoint-dir", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return data, tmp_path / "ckpt", _train_auc(done.stdout)


def _scores_by_hand(root: Path, window: Path, scratch: Path) -> np.ndarray:
    """The checkpoint's model, its tables unsharded by stock DCP, scoring ``window`` in one pass."""
    state, meta = saved_state(root, scratch)
    model = HSTU(HSTUConfig.from_dict(meta["hstu"]))
    model.load_state_dict({k: v for k, v in state["model"].items() if k in model.state_dict()})
    reader = SequenceReader(window, 1000, max_history=100)
    with torch.no_grad():
        return np.concatenate([torch.sigmoid(model.eval()(b.features)).numpy() for b in reader])


def _infer(data: Path, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> tuple[pa.Table, str]:
    """``infer``'s rows (by row and candidate) of window T + 1 with the checkpoint root ``root``, and its stdout."""
    assert main(["infer", "--data", str(window_path(data, 1)), "--checkpoint", str(root), "--output",
                 str(tmp_path / "out"), "--key-columns", "user", "--num-cpus", "1", "--no-progress"]) == 0
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    got = pa.concat_tables([pq.read_table(p) for p in parts]).sort_by([("row_id", "ascending"),
                                                                          ("candidate", "ascending")])
    return got, capsys.readouterr().out


def _infer_auc(out: str, rows: int) -> float:
    return float(re.search(r"AUC +(0\.\d{4}) \(offline: prediction_positive against label_positive, "
                           rf"{rows:,} rows", out)[1])


@pytest.mark.slow
def test_infer_scores_every_candidate_and_reports_trains_auc(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, root, train_auc = _trained(tmp_path, capsys)
    window = window_path(data, 1)
    got, out = _infer(data, root, tmp_path, capsys)
    assert got.column_names == ["user", "row_id", "candidate", "candidate_item", "label_positive",
                                "prediction_positive"]
    source = pq.read_table(window)
    assert got.num_rows == sum(len(x) for x in source.column("candidate_item").to_pylist())
    assert got.column("candidate_item").to_pylist() == [i for row in source.column("candidate_item").to_pylist()
                                                        for i in row]
    users = source.column("user").to_numpy()
    assert (got.column("user").to_numpy() == users[got.column("row_id").to_numpy()]).all()
    np.testing.assert_allclose(got.column("prediction_positive").to_numpy(),
                               _scores_by_hand(root, window, tmp_path / "read")[:, 0], rtol=1e-5, atol=1e-6)
    assert _infer_auc(out, got.num_rows) == pytest.approx(train_auc, abs=1.5e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_infer_reads_a_checkpoint_of_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Each rank wrote its own row shards of the tables: infer loads them whole, scores as the
    checkpoint's model does, and its offline AUC is the one the two ranks' evaluation printed."""
    data, root, train_auc = _trained_on_two_ranks(tmp_path)
    got, out = _infer(data, root, tmp_path, capsys)
    np.testing.assert_allclose(got.column("prediction_positive").to_numpy(),
                               _scores_by_hand(root, window_path(data, 1), tmp_path / "read")[:, 0],
                               rtol=1e-5, atol=1e-6)
    assert _infer_auc(out, got.num_rows) == pytest.approx(train_auc, abs=1.5e-4)


def _legacy_checkpoint(directory: Path, model: HSTU, world_size: int) -> None:
    """The layout ``train --model hstu`` wrote before its checkpoints went through DCP: per rank a
    dense file (the stack, heads and Adam) and a tables file, then meta.json, whose model record
    predates the STU variants (``model``: a :func:`_old_model`)."""
    assert model.config.stu == "legacy"
    directory.mkdir(parents=True)
    state = model.state_dict()
    dense = {k: v for k, v in state.items() if not k.startswith("embeddings.")}
    torch.save({"model": dense, "adam": {}, "step": 3, "epoch": 0, "batch": 3}, directory / "dense-rank-000.pt")
    torch.save({k: v for k, v in state.items() if k not in dense}, directory / "tables-rank-000.pt")
    (directory / "meta.json").write_text(json.dumps({"world_size": world_size, "step": 3, "epoch": 0, "batch": 3,
                                                     "hstu": _old_record(model.config)}))


def _old_model(item_rows: int, action_rows: int) -> HSTU:
    """An HSTU of the layer checkpoints held before the STU variants."""
    return HSTU(HSTUConfig(item_rows=item_rows, action_rows=action_rows, stu="legacy", dropout=0.0))


def _old_record(config: HSTUConfig) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in ("stu", "dropout")}


def test_a_legacy_checkpoint_of_one_rank_still_loads(tmp_path: Path) -> None:
    from torchrec_tpu.hstu.inference import load_hstu_inference

    torch.manual_seed(0)
    trained = _old_model(20, 3)
    _legacy_checkpoint(tmp_path / "step-00000003", trained, world_size=1)
    loaded = load_hstu_inference(tmp_path)
    assert loaded.step == 3 and loaded.model.config.stu == "legacy"
    expected = trained.state_dict()
    for key, value in loaded.model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


def test_a_legacy_checkpoint_of_two_ranks_is_refused_by_name(tmp_path: Path) -> None:
    from torchrec_tpu.hstu.inference import load_hstu_inference

    _legacy_checkpoint(tmp_path / "step-00000003", _old_model(20, 3), world_size=2)
    with pytest.raises(ValueError, match="written by 2 ranks in the legacy layout.*only the legacy checkpoints of "
                                         "one-rank runs load"):
        load_hstu_inference(tmp_path)


@pytest.mark.parametrize("column, value, shown", [("label_positive", 7.0, "7.0 is not a label in"),
                                                  ("candidate_item", 2.5, "2.5 is not an integer")])
def test_a_bad_label_or_fractional_id_is_refused_naming_its_row_in_the_file(tmp_path, capsys, column, value, shown):
    data = _dataset(tmp_path)
    _legacy_checkpoint(tmp_path / "ckpt" / "step-00000003", _old_model(30, 2), 1)
    table = pq.read_table(window_path(data, 1))
    rows = [[float(v) for v in r] for r in table.column(column).to_pylist()]
    rows[10][0] = value
    edited = tmp_path / "edited.parquet"
    index = table.schema.get_field_index(column)
    pq.write_table(table.set_column(index, column, pa.array(rows, pa.list_(pa.float64()))), edited, row_group_size=8,
                   write_page_checksum=True)
    assert main(["infer", "--data", str(edited), "--checkpoint", str(tmp_path / "ckpt"), "--output",
                 str(tmp_path / "out"), "--num-cpus", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"torchrec-tpu infer: error: {edited}: row 10, column {column}: {shown}") and "\n" not in err


@pytest.mark.slow
def test_infer_on_the_stack_scores_as_the_cpu_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--device tpu``: the tables in the sharded SparseCore EC, the STU stack and heads on the tpu
    device, scoring every candidate as the eager CPU model does."""
    data, root, _ = _trained(tmp_path, capsys)
    argv = ["infer", "--data", str(window_path(data, 1)), "--checkpoint", str(root), "--num-cpus", "1",
            "--no-progress", "--batch-size", "32"]
    scores = {}
    for device in ("cpu", "tpu"):
        assert main([*argv, "--device", device, "--output", str(tmp_path / device)]) == 0, capsys.readouterr().err
        logged = capsys.readouterr().out
        parts = sorted((tmp_path / device).glob("part-*.parquet"))
        scores[device] = pa.concat_tables([pq.read_table(p) for p in parts])
    assert "the stack: tables on the SparseCore ops, the STU stack and heads on the tpu device" in logged
    assert scores["tpu"].drop(["prediction_positive"]).equals(scores["cpu"].drop(["prediction_positive"]))
    np.testing.assert_allclose(scores["tpu"].column("prediction_positive").to_numpy(),
                               scores["cpu"].column("prediction_positive").to_numpy(), rtol=0, atol=1e-6)


def test_a_legacy_checkpoint_is_refused_on_the_stack_by_name(tmp_path: Path) -> None:
    from torchrec_tpu.hstu.inference import load_hstu_inference

    _legacy_checkpoint(tmp_path / "step-00000003", _old_model(20, 3), world_size=1)
    with pytest.raises(ValueError, match=r"--device tpu: checkpoint .*step-00000003 is in the legacy one-rank "
                                         r"layout, which only --device cpu loads"):
        load_hstu_inference(tmp_path, "tpu")
