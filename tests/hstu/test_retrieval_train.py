"""``train --model hstu --task retrieval``: a MovieLens ratings file trained a few steps, the
reported HR/NDCG/MRR equal to a plain loop that ranks every user's last item by hand, and a resumed
run equal to an uninterrupted one (slow: real runs); every train option acts for the retrieval task
or is refused in one line."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.hstu.train_options import LAUNCH_OPTIONS, a_value, job_source, options_of_help
from tests.hstu.train_options import config_of as _config
from torchrec_tpu.cli import main
from torchrec_tpu.hstu.retrieval_job import run_retrieval, sequence_batch
from torchrec_tpu.hstu.retrieval_metrics import MAX_K
from torchrec_tpu.train.checkpoint.manifest import CheckpointError
from torchrec_tpu.train.config import OPTIONS, SHORTHANDS, ConfigError, TrainConfig
from torchrec_tpu.train.model_kinds import HSTU_RETRIEVAL, MODEL_KINDS

RETRIEVAL = ["--model", "hstu", "--task", "retrieval"]


def _ratings_dat(path, users=48, movies=40, seed=0):
    """MovieLens-1M's ``UserID::MovieID::Rating::Timestamp`` lines: 4 to 12 ratings a user, ids from 1."""
    rng = np.random.default_rng(seed)
    lines = []
    for user in range(1, users + 1):
        count = int(rng.integers(4, 13))
        movies_rated = rng.choice(np.arange(1, movies + 1), size=count, replace=False)
        for movie, t in zip(movies_rated, np.sort(rng.integers(978_000_000, 979_000_000, count))):
            lines.append(f"{user}::{movie}::{int(rng.integers(1, 6))}::{t}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _ranks_by_hand(model, ratings):
    """Each user's last rated movie's 1-based rank among all rated movies by the output at the movie
    before it, the movies before it left out (a seen target: MAX_K + 1), one user at a time."""
    rows = [line.split("::") for line in ratings.read_text().split()]
    by_user: dict[int, list[tuple[int, int]]] = {}
    for user, movie, _, t in rows:
        by_user.setdefault(int(user), []).append((int(t), int(movie)))
    catalog = sorted({int(r[1]) for r in rows})
    table = F.normalize(model.items.weight.detach().double(), dim=-1, eps=1e-6)
    ranks = []
    model.eval()
    for user in sorted(by_user):
        events = sorted(by_user[user], key=lambda e: e[0])  # distinct times here: the order is unambiguous
        movies, times = [m for _, m in events], [t for t, _ in events]
        batch = sequence_batch([np.array(movies)], [np.array(times)], np.array([0]), model.config.max_history)
        with torch.no_grad():
            query = F.normalize(model(batch)[-1].double(), dim=-1, eps=1e-6)
        seen, target = set(movies[:-1]), movies[-1]
        score = {m: float(query @ table[m]) for m in catalog}
        above = sum(1 for m in catalog if m not in seen and score[m] > score[target])
        ranks.append(MAX_K + 1 if target in seen or above + 1 > min(MAX_K, len(catalog)) else above + 1)
    return ranks


@pytest.mark.slow
def test_retrieval_trains_on_movielens_ratings_and_reports_the_hand_ranked_metrics(tmp_path, caplog):
    ratings = _ratings_dat(tmp_path / "ratings.dat")
    config = TrainConfig.from_options(model="hstu", task="retrieval", data=str(ratings), batch_size=16, max_steps=3,
                                      eval_every=2, eval_batch_size=10, in_batch_negatives=8, random_negatives=16,
                                      log_every=1, log_dir=str(tmp_path / "tb"), progress=False)
    with caplog.at_level(logging.INFO):
        summary = run_retrieval(config)
    ranks = np.array(_ranks_by_hand(summary.model, ratings), dtype=np.float64)
    expected = {"hr@10": np.mean(ranks <= 10), "hr@50": np.mean(ranks <= 50), "hr@200": np.mean(ranks <= 200),
                "ndcg@10": np.mean(np.where(ranks <= 10, 1 / np.log2(ranks + 1), 0.0)), "mrr": np.mean(1 / ranks)}
    got = summary.result.eval
    assert got.samples == 48 and set(got.metrics) == set(expected)
    for name, value in expected.items():
        assert got.metrics[name] == pytest.approx(value, abs=1e-9), name
    assert 0 < expected["hr@10"] < 1  # ranks spread over the 40 movies: the check is not of a degenerate case
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in said if m.startswith("eval step")] == ["eval step 2", "eval step 3"]
    assert f"eval step 3: {got.describe()}" in said and f"HR@10 {expected['hr@10']:.4f}" in got.describe()
    assert got.describe() in summary.format()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tb = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert tb["eval/mrr"][-1] == pytest.approx(expected["mrr"], rel=1e-6) and len(tb["eval/hr@200"]) == 2
    assert len(tb["train/loss"]) == 3 and all(math.isfinite(v) for v in tb["train/loss"])


def test_every_train_option_acts_for_retrieval_or_is_refused_in_one_line():
    reads, source = HSTU_RETRIEVAL.reads, job_source(HSTU_RETRIEVAL)
    assert reads is not None
    for action in options_of_help():
        flag, dest = action.option_strings[0], action.dest
        if dest in LAUNCH_OPTIONS or dest in ("model", "task"):  # they pick the job
            continue
        targets = SHORTHANDS[dest].targets if dest in SHORTHANDS else (dest,)
        if all(t in reads for t in targets):
            for target in targets:
                field = OPTIONS[target][1].name
                assert re.search(rf"\.{field}\b", source), f"{flag} is in retrieval's reads, and its job never reads it"
            continue
        with pytest.raises(ConfigError) as refused:
            _config([*RETRIEVAL, flag, *a_value(action)])
        assert str(refused.value) == f"{flag} does not apply to --model hstu --task retrieval"


def test_the_task_picks_the_defaults_and_only_hstu_has_retrieval(capsys):
    config = _config([*RETRIEVAL, "--in-batch-negatives", "4"])
    assert config.kind is HSTU_RETRIEVAL and config.kind.load("job") is run_retrieval
    assert (config.data.batch_size, config.optim.dense_lr, config.model.random_negatives) == (128, 1e-3, 128)
    assert _config([*RETRIEVAL, "--batch-size", "64"]).data.batch_size == 64
    assert _config(["--model", "hstu", "--task", "ranking"]).kind is MODEL_KINDS["hstu"]
    for model in ("dlrm", "dlrmv4"):
        with pytest.raises(ConfigError, match=rf"^--task retrieval does not apply to --model {model} \(it is built "
                                              r"for --model hstu\)$"):
            _config(["--model", model, "--task", "retrieval"])
    with pytest.raises(ConfigError, match=r"^--random-negatives does not apply to --model hstu$"):
        _config(["--model", "hstu", "--random-negatives", "4"])
    with pytest.raises(ConfigError, match="are for --task retrieval"):
        _config(["--random-negatives", "4"])
    with pytest.raises(ConfigError, match="needs at least one negative"):
        _config([*RETRIEVAL, "--random-negatives", "0"])
    assert main(["train", *RETRIEVAL, "--data", "sample"]) == 2
    assert "none with the 3 a leave-one-out split needs" in capsys.readouterr().err
    assert main(["profile", *RETRIEVAL]) == 2
    assert "not built for this model yet" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path):
    ratings = _ratings_dat(tmp_path / "ratings.dat", users=40)
    options = dict(model="hstu", task="retrieval", data=str(ratings), batch_size=16, epochs=2, eval_batch_size=40,
                   in_batch_negatives=4, random_negatives=8, progress=False)  # 3 batches an epoch, the last of 8 users
    whole = run_retrieval(TrainConfig.from_options(**options, checkpoint_every=4, log_dir=str(tmp_path / "a")))
    step_4 = next((tmp_path / "a" / "checkpoint").glob("checkpoint.step-00000004.*"))
    resumed = run_retrieval(TrainConfig.from_options(**options, resume=str(step_4), log_dir=str(tmp_path / "b")))
    assert whole.result.steps == resumed.result.steps == 6
    for name, weights in whole.model.state_dict().items():
        assert torch.equal(weights, resumed.model.state_dict()[name]), name
    assert resumed.result.eval.metrics == whole.result.eval.metrics
    with pytest.raises(CheckpointError, match="not a checkpoint of --task retrieval"):
        run_retrieval(TrainConfig.from_options(**options, resume=str(tmp_path), log_dir=str(tmp_path / "c")))
