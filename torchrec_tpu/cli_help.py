"""Help text conventions shared by every ``torchrec-tpu`` subcommand: each flag's default once, and
a flag mistake answered in two lines (the error, where the flags are listed), not the usage block."""

from __future__ import annotations

import argparse
from typing import NoReturn

from torchrec_tpu.errors import says_shared_errors


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
