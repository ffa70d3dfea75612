"""One trainer, several models (torchrec_tpu/train/model_kinds.py): a model's defaults apply where
neither a flag nor the YAML file sets the option (an explicit ``--batch-size 512`` trains at 512),
and every option of ``train --help`` either acts for a model that names the options it reads
(``hstu``, ``dlrmv4``) or is refused in one line; the read ones act through the one training
loop (slow: real runs)."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
import torch

from pipelines.sequences import window_path
from tests.hstu.datasets import sequence_dataset
from tests.hstu.train_options import LAUNCH_OPTIONS, a_value, job_source, options_of_help
from tests.hstu.train_options import config_of as _config
from torchrec_tpu.cli import main
from torchrec_tpu.train.config import OPTIONS, SHORTHANDS, ConfigError, TrainConfig
from torchrec_tpu.train.model_kinds import MODEL_KINDS

READING_MODELS = [name for name, kind in MODEL_KINDS.items() if kind.reads is not None]  # the others read all


def test_an_explicit_batch_size_beats_the_models_default_and_the_default_fills_in_otherwise(tmp_path):
    assert _config(["--model", "hstu", "--batch-size", "512"]).data.batch_size == 512  # was 128: 512 is DLRM's
    hstu = _config(["--model", "hstu"])
    assert (hstu.data.batch_size, hstu.optim.dense_lr, hstu.loop.epochs) == (128, 3e-3, 2)
    assert _config([]).data.batch_size == TrainConfig().data.batch_size == 512
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model: hstu\nepochs: 1\n")
    from_yaml = _config(["--config", str(yaml)])
    assert (from_yaml.data.batch_size, from_yaml.loop.epochs) == (128, 1)  # the YAML's model's defaults, its epochs
    assert _config(["--config", str(yaml), "--model", "dlrm"]).data.batch_size == 512  # the flag's model
    saved = TrainConfig.from_options(model="hstu", batch_size=512).to_dict()
    assert TrainConfig.from_options(**saved).data.batch_size == 512  # a checkpoint's config reads back as written


@pytest.mark.parametrize("model", READING_MODELS)
def test_every_train_option_acts_for_the_model_or_is_refused_in_one_line(model):
    reads, source = MODEL_KINDS[model].reads, job_source(MODEL_KINDS[model])
    assert reads is not None
    seen = set()
    for action in options_of_help():
        flag, dest = action.option_strings[0], action.dest
        seen.add(dest)
        if dest in LAUNCH_OPTIONS or dest == "task":  # --task picks the registry's entry (test_retrieval_train.py)
            continue
        assert dest in OPTIONS or dest in SHORTHANDS, f"{flag}: neither a training option nor a launch option"
        targets = SHORTHANDS[dest].targets if dest in SHORTHANDS else (dest,)
        if all(t in reads for t in targets):
            for target in targets:  # read by the job: its config field is read there
                field = OPTIONS[target][1].name
                assert re.search(rf"\.{field}\b", source), f"{flag} is in {model}'s reads, and its job never reads it"
            continue
        with pytest.raises(ConfigError) as refused:
            _config(["--model", model, flag, *a_value(action)])
        assert str(refused.value) == f"{flag} does not apply to --model {model}"
    assert LAUNCH_OPTIONS <= seen


@pytest.mark.slow
def test_hstu_trains_at_the_given_batch_size_evaluates_every_n_steps_and_sets_its_threads(tmp_path, capfd):
    data = sequence_dataset(tmp_path / "seq", users=1200, items=40, events_per_user=12, seed=1, max_history=10)
    assert pq.read_metadata(window_path(data, 0)).num_rows >= 2 * 512
    from torchrec_tpu.train.distributed import threads_for_this_rank

    if threads_for_this_rank(2) < 2:
        pytest.skip("one CPU: --num-threads 2 is capped to 1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", "--model", "hstu", "--data", str(data), "--batch-size", "512", "--max-steps", "2",
                     "--eval-every", "1", "--num-threads", "2", "--checkpoint-every", "1", "--limit-val-batches", "1",
                     "--dense-device", "cpu", "--log-dir", str(tmp_path / "tb"), "--no-progress"]) == 0
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    said = capfd.readouterr()
    assert threads == 2
    first = json.loads(next((tmp_path / "tb" / "checkpoint").glob("checkpoint.step-00000001.*/meta.json")).read_text())
    assert (first["row"], first["config"]["batch_size"]) == (512, 512)  # one step: 512 users
    assert re.findall(r"eval step (\d): positive", said.out + said.err) == ["1", "2"], said


@pytest.mark.slow
def test_a_resume_that_cannot_continue_leaves_no_run_directory(tmp_path, capsys):
    data = sequence_dataset(tmp_path / "seq", users=40, items=20, events_per_user=8, seed=2, max_history=6)
    assert main(["train", "--model", "hstu", "--data", str(data), "--resume", str(tmp_path / "seq"),
                 "--dense-device", "cpu", "--log-dir", str(tmp_path / "run"), "--no-progress"]) == 2
    assert "not an HSTU checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_model_reading_every_option_refuses_none():
    assert MODEL_KINDS["dlrm"].refused(["dense_arch", "stu"]) == []  # the config's own checks speak for DLRM
    assert MODEL_KINDS["hstu"].refused(["dense_arch", "batch_size", "plan"]) == ["dense_arch", "plan"]
    with pytest.raises(ConfigError, match=r"^--plan does not apply to --model dlrmv4$"):
        _config(["--model", "dlrmv4", "--plan", "auto"])
