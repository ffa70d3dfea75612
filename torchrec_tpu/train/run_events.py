"""What the training loop reports as it runs, for whoever records a run's timeline.

:class:`RunEvents` does nothing; :mod:`torchrec_tpu.train.mllog` (MLPerf's compliance log) is what
overrides it. The loop (:func:`torchrec_tpu.train.loop.run_training`) calls, in order: ``run_started``
once; per epoch ``epoch_started`` ... ``epoch_stopped``; around each stretch of training steps between
evaluations ``steps_started`` ... ``steps_stopped``; around each held-out evaluation ``eval_started``
... ``eval_stopped``; ``run_stopped`` once after the last held-out evaluation (the test split's is
not reported). ``epoch_num`` is the fractional epoch (1.5: half way through the second),
``samples`` the training samples of every rank so far this run.
"""

from __future__ import annotations

from torchrec_tpu.train.metrics import EvalResult


class RunEvents:
    """The loop's events; every method is a no-op here."""

    def run_started(self, epoch_num: float) -> None:
        """Training is about to take its first step (everything is built and loaded)."""

    def epoch_started(self, epoch: int, samples: int) -> None:
        """Epoch ``epoch`` (0-based) takes its first step next."""

    def epoch_stopped(self, epoch: int, samples: int) -> None:
        """Epoch ``epoch`` took its last step (or the run stopped within it)."""

    def steps_started(self, epoch_num: float, samples: int) -> None:
        """Training steps start: the run's first, or the first after an evaluation."""

    def steps_stopped(self, epoch_num: float, samples: int) -> None:
        """Training steps stop: for an evaluation, or at the end of training."""

    def eval_started(self, epoch_num: float, samples: int) -> None:
        """A held-out evaluation starts."""

    def eval_stopped(self, epoch_num: float, samples: int, result: EvalResult) -> None:
        """That evaluation ended with ``result``."""

    def run_stopped(self, epoch_num: float, samples: int, reached_target: bool) -> None:
        """Training is over: ``reached_target`` when an evaluation reached ``--target-auc``."""
