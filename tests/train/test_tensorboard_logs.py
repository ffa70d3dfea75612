"""What a training run leaves for TensorBoard besides the loss curves: the run's hyperparameters
(HParams tab) and the learning rate of every step."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

from torchrec_tpu.train.job import HPARAM_METRICS


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
    assert set(values) == set(expected)
    for name in ("batch_size", "embedding_dim", "dense_lr", "sparse_lr", "engine", "dense_arch", "progress"):
        assert values[name] == expected[name], name
    assert values["resume"] == "None"  # None has no TensorBoard type: written as text
    assert sorted(metrics) == sorted(HPARAM_METRICS)


def test_learning_rate_is_logged_every_step(trained) -> None:
    config, summary = trained
    events = _events(summary.log_dir)
    for tag, expected in (("dense", config.optim.dense_lr), ("sparse", config.optim.sparse_lr)):
        rates = [(e.step, e.value) for e in events.Scalars(f"train/learning_rate/{tag}")]
        assert [step for step, _ in rates] == list(range(1, summary.result.steps + 1))
        assert all(abs(value - expected) < 1e-7 for _, value in rates)
