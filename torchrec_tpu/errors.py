"""How the ``torchrec-tpu`` CLI reports a failure: one ``torchrec-tpu CMD: error:`` line on stderr, rc 2
for a user error (a bad flag, file or value: the line says it all), rc 1 otherwise, with the full
traceback in a log file (its path on the next line) instead of on the terminal.

Errors raised inside Ray workers arrive wrapped in Ray's exception types, whose text embeds every
worker traceback; the line shows the original exception's message instead. Exceptions outside the
user-error families (bad values, files, YAML/JSON, collectives that failed) are labelled internal
errors, still on one line.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback
from pathlib import Path

from torchrec_tpu.launcher import is_rank
from torchrec_tpu.rank_report import claim_report
from tpu_facts import knobs

MAX_MESSAGE_CHARS = 600
USER_ERROR = 2  # exit code of a user error (bad flag, file or value); argparse's own code for bad flags


class CollectiveError(RuntimeError):
    """A collective across ranks failed or timed out; the message names it and the ranks."""


def is_user_error(error: BaseException) -> bool:
    """Whether ``error`` belongs to the families reported as they are (bad values, files,
    YAML/JSON, collectives), not as internal errors."""
    if isinstance(error, (ValueError, OSError, LookupError, ArithmeticError, CollectiveError)):
        return True
    module = type(error).__module__
    return module.startswith("yaml") or module.startswith("torch.distributed")


def root_cause(error: BaseException) -> BaseException:
    """The exception a user raised, with Ray's task/actor wrappers taken off."""
    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        if not type(error).__module__.startswith("ray"):
            break
        inner = getattr(error, "cause", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    return error


def one_line(error: BaseException) -> str:
    """The exception's message on one line (whitespace collapsed, at most MAX_MESSAGE_CHARS)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def _log_path(command: str) -> Path:
    root = Path(knobs.ERROR_LOG_DIR.value() or Path(tempfile.gettempdir()) / "torchrec-tpu-logs")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    rank = os.environ.get("RANK")
    return root / f"{command.replace(' ', '-')}-{stamp}-pid{os.getpid()}{f'-rank{rank}' if rank else ''}.log"


def write_log(command: str, error: BaseException) -> Path | None:
    """The traceback of ``error`` in a new log file; None when no log can be written."""
    path = _log_path(command)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(error)))
    except OSError:
        return None
    return path


def print_error(command: str, message: str, log: Path | None = None) -> None:
    """The one error line every subcommand prints: ``torchrec-tpu CMD: error: MESSAGE`` (and the
    traceback file below it), in one write so the lines of ranks sharing a stderr never interleave."""
    text = f"torchrec-tpu {command}: error: {message}\n"
    if log is not None:
        text += f"  (full traceback in {log})\n"
    sys.stderr.write(text)


def says_shared_errors() -> bool:
    """Whether this process says an error every rank of its job may meet (a user error, a failed
    collective): a single process does; of several ranks, the first of the job to ask
    (:func:`torchrec_tpu.rank_report.claim_report`)."""
    return not is_rank() or claim_report()


def report_user_error(command: str, error: BaseException) -> int:
    """Print ``error`` (a bad flag, file or value) as the one error line (once at several ranks:
    :func:`says_shared_errors`); returns USER_ERROR, 2."""
    if says_shared_errors():
        print_error(command, one_line(root_cause(error)))
    return USER_ERROR


def report_failure(command: str, error: BaseException) -> int:
    """Print the one-line report of ``error`` and return the exit code: 2 for the user-error
    families, 1 (the traceback's log path below the line) for collectives that failed and internal
    errors. At several ranks a user error or a failed collective is said once
    (:func:`says_shared_errors`); an internal error by every rank that meets it."""
    cause = root_cause(error)
    message = one_line(cause)
    rc, shared = 1, True
    if isinstance(cause, CollectiveError):  # names the collective and the ranks already
        pass
    elif isinstance(cause, RuntimeError) and ("gloo" in message or "tpu_dist" in message):  # a peer failed
        message = f"a collective with the other ranks failed (see their errors): {message}"
    elif not is_user_error(cause):
        message, shared = f"internal error ({type(cause).__name__}): {message}", False
    else:
        rc = USER_ERROR
    if shared and not says_shared_errors():
        return rc
    print_error(command, message, None if rc == USER_ERROR else write_log(command, error))
    return rc
