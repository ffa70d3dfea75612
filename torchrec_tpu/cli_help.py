"""Help text conventions shared by every ``torchrec-tpu`` subcommand: each flag's default once."""

from __future__ import annotations

import argparse


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
