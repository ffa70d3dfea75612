"""torchrun running torchrec-tpu's CLI ends a failed job with the ranks' own line, not its page.

A rank of the CLI that fails says so in one line (once per job for a user error,
:mod:`torchrec_tpu.rank_report`) and exits 1 or 2. torchrun then logs the failure and raises
``ChildFailedError``, whose traceback and 20-line summary repeat nothing the line did not say. In
torchrun's own process (PyTorch's device-backend autoload runs
:mod:`torchrec_tpu._torch_tpu_autoload` at its ``import torch``), when its command line runs the
CLI, this module drops that log line and ends torchrun quietly with the rank's exit code. A rank
that died any other way (a signal, the OOM killer) keeps torchrun's full report. Standard library
only: it runs inside every ``import torch`` of a torchrun process.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import TracebackType

SAID = (1, 2)  # the CLI's exit codes after its one line (cli.main: internal error, user error)
_FAILED_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def is_torchrun_of_the_cli(argv: list[str]) -> bool:
    """Whether ``argv`` (the interpreter's command line, ``sys.orig_argv``) is torchrun's (the
    ``torchrun`` script or ``python -m torch.distributed.run``) running torchrec-tpu's CLI
    (``-m torchrec_tpu.cli`` or the ``torchrec-tpu`` script)."""
    script = next((i for i, a in enumerate(argv) if Path(a).name == "torchrun"), None)
    module = next((i + 1 for i, a in enumerate(argv[:-1])
                   if a == "-m" and argv[i + 1] == "torch.distributed.run"), None)
    start = script if script is not None else module
    return start is not None and any(a == "torchrec_tpu.cli" or Path(a).name == "torchrec-tpu"
                                     for a in argv[start + 1:])


class _DropLaunchNoise(logging.Filter):
    """torchrun's "failed (exitcode: N) local_rank: ..." line when the rank said its error (N in
    SAID), and its "Sending process P closing signal" lines (a page that follows lists the signals)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        said = message.startswith("failed (exitcode:") and bool(record.args) and record.args[0] in SAID
        return not (said or message.startswith("Sending process"))


def _quiet_exit(previous: type(sys.excepthook)) -> type(sys.excepthook):
    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if kind.__name__ == "ChildFailedError" and hasattr(error, "get_first_failure"):
            _, failure = error.get_first_failure()
            if failure.exitcode in SAID:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(failure.exitcode)
        previous(kind, error, tb)

    return hook


def install() -> None:
    """In a torchrun process running the CLI: the failed-rank log line and ``ChildFailedError``'s
    page left out where the rank said its error (module docstring); nothing elsewhere."""
    if not is_torchrun_of_the_cli(getattr(sys, "orig_argv", sys.argv)):
        return
    logging.getLogger(_FAILED_LOGGER).addFilter(_DropLaunchNoise())
    sys.excepthook = _quiet_exit(sys.excepthook)
