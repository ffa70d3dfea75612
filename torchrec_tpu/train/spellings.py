"""One option, one value: an option given on one command line under two spellings (``--embedding_dim
8 --embedding-dim 16``, ``--validation-freq`` and ``--eval-every``, ``--adagrad`` and
``--sparse-optimizer sgd``) with different values is refused naming both, instead of the last one
silently winning. The same spelling repeated keeps argparse's rule: the last one counts.

:func:`record_spellings` makes a parser's actions note, per option, the value each spelling set;
:func:`conflicting_spellings` reads the notes off the parsed namespace.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Collection

from torchrec_tpu.train.dlrm_main_flags import options_set_by

_GIVEN = "_given_spellings"  # namespace attribute: option -> {spelling: value}


class _Recording(argparse.Action):
    """Mixed into an action's class: after it sets its options, notes their values by spelling."""

    options: tuple[str, ...] = ()

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        given = namespace.__dict__.setdefault(_GIVEN, {})
        for option in self.options:
            if option_string is not None and hasattr(namespace, option):
                shown = _shown(option_string, option, getattr(namespace, option), direct=option == self.dest)
                given.setdefault(option, {})[option_string] = (getattr(namespace, option), shown)


@functools.cache
def _recording(cls: type[argparse.Action]) -> type[argparse.Action]:
    return type(f"Recording{cls.__name__}", (_Recording, cls), {})


def record_spellings(parser: argparse.ArgumentParser, options: Collection[str]) -> None:
    """Every action of ``parser`` setting one of ``options`` records what each spelling set."""
    for action in parser._actions:
        set_options = tuple(o for o in (options_set_by(action) or (action.dest,)) if o in options)
        if set_options and not isinstance(action, _Recording):
            action.__class__ = _recording(type(action))
            action.options = set_options  # type: ignore[attr-defined]


def conflicting_spellings(args: argparse.Namespace) -> str | None:
    """The error naming both spellings when two spellings gave one option different values (None: none did)."""
    for option, by_spelling in getattr(args, _GIVEN, {}).items():
        (value, shown), *others = by_spelling.values()
        for other_value, other_shown in others:
            if other_value != value:
                return (f"{shown} and {other_shown} set the same option (--{option.replace('_', '-')}) to different "
                        "values; give it once")
    return None


def _shown(spelling: str, option: str, value: Any, direct: bool) -> str:
    """``--embedding_dim 8``, ``--no-progress``, or ``--adagrad (--sparse-optimizer adagrad)`` for a
    flag setting another option."""
    if direct:
        return spelling if isinstance(value, bool) else f"{spelling} {value}"
    return f"{spelling} (--{option.replace('_', '-')} {value})"
