"""Scalar logging to TensorBoard event files (primary rank only) with an in-memory copy."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, Mapping, Sequence

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams


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
        the last value of each scalar in ``metric_tags``. Values other than bool/int/float/str
        (None, say) are written as their ``str``."""
        if self._writer is None:
            return
        plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
        for summary in hparams(plain, {tag: 0.0 for tag in metric_tags}):
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
