"""What a training run leaves for TensorBoard besides the loss curves: the run's hyperparameters
(HParams tab) and the learning rate of every step."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

from torchrec_tpu.train.job import HPARAM_METRICS
from torchrec_tpu.train.scalars import ScalarLog


def _events(log_dir) -> EventAccumulator:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def _hparams(events: EventAccumulator):
    """(hyperparameters of the session, metric tags of the experiment) as TensorBoard reads them."""
    values = {}
    contents = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    start = hparams_metadata.parse_session_start_info_plugin_data(
        contents[hparams_metadata.SESSION_START_INFO_TAG])
    for name, value in start.hparams.items():
        values[name] = getattr(value, value.WhichOneof("kind"))
    experiment = hparams_metadata.parse_experiment_plugin_data(contents[hparams_metadata.EXPERIMENT_TAG])
    metrics = [m.name.tag for m in experiment.metric_infos]
    return values, metrics


def test_hparams_hold_the_run_config(trained) -> None:
    config, summary = trained
    values, metrics = _hparams(_events(summary.log_dir))
    expected = config.to_dict()
    assert set(values) == {name for name, value in expected.items() if value is not None}
    for name in ("dense_lr", "sparse_lr", "engine", "dense_arch", "progress"):
        assert values[name] == expected[name], name
    assert (values["batch_size"], values["embedding_dim"]) == (str(expected["batch_size"]),
                                                                str(expected["embedding_dim"]))
    assert "resume" not in values  # None (unset) is left out, not written as the text "None"
    assert sorted(metrics) == sorted(HPARAM_METRICS)


def test_hparams_keep_each_value_type(tmp_path) -> None:
    """Booleans as TensorBoard booleans (torch's own writer makes them numbers), whole numbers as
    their text (the HParams tab shows a number value 512 as "512.00"), other numbers as numbers,
    paths as given, no "None" strings."""
    values = {"progress": False, "bind_cpus": True, "batch_size": 256, "dense_lr": 0.05, "data": "data/criteo",
              "resume": None}
    with ScalarLog(tmp_path, enabled=True) as log:
        log.log_hparams(values, ["eval/auc"])
    written, metrics = _hparams(_events(tmp_path))
    assert written == {"progress": False, "bind_cpus": True, "batch_size": "256", "dense_lr": 0.05,
                       "data": "data/criteo"}
    assert [type(written[name]) for name in ("progress", "bind_cpus", "dense_lr", "data")] == [bool, bool, float, str]
    assert metrics == ["eval/auc"]


def test_learning_rate_is_logged_every_step(trained) -> None:
    config, summary = trained
    events = _events(summary.log_dir)
    for tag, expected in (("dense", config.optim.dense_lr), ("sparse", config.optim.sparse_lr)):
        rates = [(e.step, e.value) for e in events.Scalars(f"train/learning_rate/{tag}")]
        assert [step for step, _ in rates] == list(range(1, summary.result.steps + 1))
        assert all(abs(value - expected) < 1e-7 for _, value in rates)
