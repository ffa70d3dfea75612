"""What the console says during a run: a line per evaluation (AUC, loss, accuracy) and per
checkpoint, no samples/s point for the compiling first step, a missed --target-auc in the summary."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.train.scripted_loop import Logistic, ScriptedSteps, constant_batches
from torchrec_tpu.train.job import JobSummary
from torchrec_tpu.train.loop import LoopOptions, run_training
from torchrec_tpu.train.scalars import ScalarLog


def _held_out() -> list:
    """Two batches whose logits under Logistic are known: dense features (i, -i) per row."""
    batches = constant_batches(2)
    for i, batch in enumerate(batches):
        batch.dense_features.copy_(torch.tensor([[-2.0, 1.0], [1.0, 0.5], [0.5, 3.0], [3.0, -1.0]]) * (i + 1))
    return batches


def _run(tmp_path: Path, caplog, steps: int = 6, **options):
    model = Logistic()
    with torch.no_grad():  # a fixed model (lr 0 keeps it): held-out AUC 0.75 at every evaluation
        model.linear.weight.copy_(torch.tensor([[1.0, 0.5]]))
        model.linear.bias.zero_()
    saved: list[int] = []

    def checkpoint(step, position):
        saved.append(step)
        return tmp_path / f"ckpt-{step}"

    with caplog.at_level(logging.INFO, logger="torchrec_tpu"), ScalarLog(tmp_path / "tb", enabled=True) as log:
        result = run_training(model, torch.optim.SGD(model.parameters(), lr=0.0), constant_batches(steps), _held_out(),
                              torch.device("cpu"), log, LoopOptions(progress=True, **options),
                              step_fn=ScriptedSteps([0.5] * steps), checkpoint=checkpoint)
    return model, result, [r.getMessage() for r in caplog.records], saved


def _expected(model) -> tuple[float, float, float, float]:
    """AUC, NE, mean BCE loss and accuracy at 0.5 of the held-out batches, computed here."""
    batches = _held_out()
    with torch.no_grad():
        logits = torch.cat([model.linear(b.dense_features).squeeze(-1) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    accuracy = ((torch.sigmoid(logits) >= 0.5).float() == labels).float().mean().item()
    positives, negatives = logits[labels == 1], logits[labels == 0]
    pairs = [(p > n) + 0.5 * (p == n) for p in positives.tolist() for n in negatives.tolist()]  # Mann-Whitney
    rate = labels.mean().item()
    ne = loss / -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))  # log loss over the base rate's entropy
    return sum(pairs) / len(pairs), ne, loss, accuracy


def test_a_line_per_evaluation_and_checkpoint(tmp_path: Path, caplog) -> None:
    model, result, lines, saved = _run(tmp_path, caplog, eval_every=2, checkpoint_every=3, log_every=2,
                                       max_steps=6)
    auc, ne, loss, accuracy = _expected(model)
    evals = [line for line in lines if line.startswith("eval step")]
    assert evals == [f"eval step {s}: AUC {auc:.4f}, NE {ne:.4f}, loss {loss:.4f}, accuracy {accuracy:.2f}"
                     for s in (2, 4, 6)]
    assert result.eval.accuracy == pytest.approx(accuracy)
    assert saved == [3]  # the last step's checkpoint is the caller's
    assert [line for line in lines if line.startswith("checkpoint")] == [f"checkpoint step 3: {tmp_path / 'ckpt-3'}"]


def test_an_evaluation_says_it_starts_and_how_far_it_is(tmp_path: Path, caplog, monkeypatch) -> None:
    """No silent minute in a long evaluation (issue 77): a line before it, then progress lines
    (every TORCHREC_TPU_PROGRESS_SECONDS; 0 here: after each batch) with the rows scored so far."""
    monkeypatch.setenv("TORCHREC_TPU_PROGRESS_SECONDS", "0")
    _, _, lines, _ = _run(tmp_path, caplog, eval_every=2, max_steps=2)
    start = lines.index("evaluating the model after step 2")
    progress = [line for line in lines if line.startswith("evaluation after step 2: ")]
    # the 2 held-out batches of 4 rows: 4, then 8 rows (50%, 100%)
    assert [line.split("  ")[0] for line in progress] == ["evaluation after step 2: 4 rows (50%)",
                                                          "evaluation after step 2: 8 rows (100%)"]
    assert start < lines.index(progress[0]) and lines.index(progress[-1]) < lines.index(
        next(line for line in lines if line.startswith("eval step 2:")))


def test_other_ranks_print_no_evaluation_lines(tmp_path: Path, caplog) -> None:
    _, _, lines, _ = _run(tmp_path, caplog, eval_every=2, checkpoint_every=3, max_steps=6, primary=False)
    assert not [line for line in lines if line.startswith(("eval", "checkpoint"))]


def test_first_step_has_no_samples_per_sec_point(tmp_path: Path, caplog) -> None:
    _, result, lines, _ = _run(tmp_path, caplog, log_every=1, max_steps=4)
    steps = [line for line in lines if line.startswith("step ")]
    assert steps[0].endswith("compiling") and "samples/s" not in steps[0], steps
    # the ETA at the pace of the steps after the first: 2 steps of 4 done when step 3 is logged
    assert all(re.fullmatch(rf"step {s}/4  epoch 0  loss 0\.\d{{4}}  [\d,]+ samples/s  ETA \d+s", line)
               for s, line in zip((2, 3, 4), steps[1:])), steps
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [e.step for e in events.Scalars("train/samples_per_sec")] == [2, 3, 4]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [4]


def test_summary_says_whether_the_target_was_reached(tmp_path: Path, caplog) -> None:
    _, missed, _, _ = _run(tmp_path, caplog, eval_every=2, max_steps=6, target_auc=0.999)
    assert missed.steps == 6 and missed.target_step is None and missed.best_eval[0] == 2  # lr 0: AUC never moves
    text = JobSummary(missed, "data", tmp_path, tmp_path, 1, True, target_auc=0.999).format()
    assert f"target AUC      0.999 MISSED: best eval AUC {missed.best_eval[1].auc:.4f} at step 2" in text
    _, reached, _, _ = _run(tmp_path, caplog, eval_every=2, max_steps=6, target_auc=0.1)
    assert reached.steps == 2 and reached.target_step == 2
    assert "target AUC      0.1 reached at step 2" in JobSummary(reached, "data", tmp_path, tmp_path, 1, True,
                                                                 target_auc=0.1).format()
    assert "target AUC" not in JobSummary(reached, "data", tmp_path, tmp_path, 1, True).format()


def test_a_progress_line_between_log_lines_at_least_every_interval(tmp_path: Path, caplog, monkeypatch) -> None:
    """--log-every longer than the run: the time-based progress lines (every
    $TORCHREC_TPU_PROGRESS_SECONDS, 0 here: every step) say step, samples/s and ETA, read no loss."""
    monkeypatch.setenv("TORCHREC_TPU_PROGRESS_SECONDS", "0")
    _, _, lines, _ = _run(tmp_path, caplog, log_every=100, max_steps=4)
    steps = [line for line in lines if line.startswith("step ")]
    assert steps[0] == "step 1/4  epoch 0  compiling", steps
    assert all(re.fullmatch(rf"step {s}/4  epoch 0  [\d,]+ samples/s  ETA \d+s", line)
               for s, line in zip((2, 3, 4), steps[1:])) and len(steps) == 4, steps


def test_summary_throughput_is_steady_and_whole_run(tmp_path: Path, caplog) -> None:
    """A short run's whole-run figure is mostly its compiling first step: the summary gives the
    steady rate (after the first step) too, and says when there is none."""
    import dataclasses

    _, result, _, _ = _run(tmp_path, caplog, max_steps=4)
    assert result.first_step_samples == 4 and result.samples == 16  # 4 rows per scripted batch
    timed = dataclasses.replace(result, samples=100, first_step_samples=10, train_seconds=11.0, first_step_seconds=10.0)
    text = JobSummary(timed, "data", tmp_path, tmp_path, 1, True).format()
    assert ("  throughput      90 samples/s steady (after the first step), 9 samples/s whole run (input + train "
            "steps, eval excluded)") in text
    single = dataclasses.replace(timed, samples=10)
    assert "  throughput      1 samples/s whole run (input + train steps, eval excluded); one step, no steady figure" \
        in JobSummary(single, "data", tmp_path, tmp_path, 1, True).format()
