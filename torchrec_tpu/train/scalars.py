"""Scalar logging to TensorBoard event files (primary rank only) with an in-memory copy."""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping, Sequence

from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from torch.utils.tensorboard import SummaryWriter

# (python type, TensorBoard type, the HParam value field); bool first: a bool is an int. An int is
# written as its text: the HParams tab shows every number value with decimals (512 as "512.00")
_HPARAM_TYPES = ((bool, api_pb2.DATA_TYPE_BOOL, "bool_value"),
                 (int, api_pb2.DATA_TYPE_STRING, "string_value"),
                 (float, api_pb2.DATA_TYPE_FLOAT64, "number_value"),
                 (str, api_pb2.DATA_TYPE_STRING, "string_value"))


class ScalarLog:
    """Writes ``tag -> value`` at a step to TensorBoard and remembers the last value of each tag.

    Only the primary rank writes event files; every rank keeps ``last`` so callers need no rank
    checks.
    """

    def __init__(self, log_dir: Path, enabled: bool) -> None:
        self.log_dir = log_dir
        self.last: dict[str, float] = {}
        self._writer = SummaryWriter(log_dir=str(log_dir)) if enabled else None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.last[tag] = float(value)
            if self._writer is not None:
                self._writer.add_scalar(tag, float(value), global_step=step)

    def log_hparams(self, values: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
        """Record the run's hyperparameters for TensorBoard's HParams tab, which shows them next to
        the last value of each scalar in ``metric_tags``: booleans as booleans, whole numbers as their
        text (``512``, not ``512.00``), other numbers as numbers, text as text (paths as given);
        None (an option left unset) is left out, other values are written as their ``str``."""
        if self._writer is None:
            return
        plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()
                 if v is not None}
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        infos = []
        for name, value in plain.items():
            kind, field = next((t, f) for python_type, t, f in _HPARAM_TYPES if isinstance(value, python_type))
            setattr(start.hparams[name], field, str(value) if field == "string_value" else value)
            infos.append(api_pb2.HParamInfo(name=name, type=kind))
        experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
            api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in metric_tags])
        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS)
        data = plugin_data_pb2.HParamsPluginData
        for tag, content in ((metadata.EXPERIMENT_TAG, data(experiment=experiment)),
                             (metadata.SESSION_START_INFO_TAG, data(session_start_info=start)),
                             (metadata.SESSION_END_INFO_TAG, data(session_end_info=end))):
            summary = Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(content))])
            self._writer.file_writer.add_summary(summary)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> ScalarLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
