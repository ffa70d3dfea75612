"""Help text conventions shared by every ``torchrec-tpu`` subcommand: each flag's default once, and
a flag mistake answered in two lines (the error, where the flags are listed), not the usage block."""

from __future__ import annotations

import argparse
from typing import NoReturn

from torchrec_tpu.errors import says_shared_errors

REFUSED = "_refused_flags"  # namespace attribute: the refusals of a whole command line, said together
NOTES = "_flag_notes"  # namespace attribute: notes on flags taken as given, said together in one line


def refuse_later(namespace: argparse.Namespace, flag: str, why: str, kind: str = "flag") -> None:
    """Keep ``flag`` (as given, with its value), refused for ``why``, for the one error of the whole
    line; ``kind`` says whose flag it is (``TorchRec dlrm_main's flag``)."""
    namespace.__dict__.setdefault(REFUSED, []).append((flag, why, kind))


def note(namespace: argparse.Namespace, message: str) -> None:
    """Keep ``message`` (what a flag taken as given does here) for the one note line of the run."""
    namespace.__dict__.setdefault(NOTES, []).append(message)


def refusals(namespace: argparse.Namespace, unknown: list[str] = ()) -> str | None:  # type: ignore[assignment]
    """Every refused flag of the parsed line (those refused for one reason together) and the
    unrecognized arguments, as one message (None: none)."""
    flags_by_reason: dict[tuple[str, str], list[str]] = {}
    for flag, why, kind in getattr(namespace, REFUSED, []):
        flags_by_reason.setdefault((why, kind), []).append(flag)
    parts = [f"{', '.join(flags)} ({kind}{'s' if len(flags) > 1 else ''}): {why}"
             for (why, kind), flags in flags_by_reason.items()]
    if unknown:
        parts.append(f"unrecognized arguments: {' '.join(unknown)}")
    return "; ".join(parts) or None


class DefaultsOnceFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an optional flag's help unless the help already names its
    default (``%(default)s`` or a ``(default: ...)`` of its own, as flags defaulting to None do).

    Required flags, positionals and suppressed defaults get nothing.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("%(default)" in text or "(default:" in text or action.required
                or not action.option_strings or action.default in (None, argparse.SUPPRESS)):
            return action.help
        return f"{text} (default: %(default)s)"


class HintingParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (an unknown or mistyped flag, a bad value, a missing required
    one) print the error line and a ``--help`` hint instead of the whole usage block first; its
    subcommands' parsers are of this class too. Exit status 2, as argparse's."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        if not says_shared_errors():  # another rank of the job said it: every rank parses the same line
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: the flags: `{self.prog} --help`\n")
