"""Close-match suggestions for a misspelt flag, option or key (``--batch_size`` -> ``--batch-size``)."""

from __future__ import annotations

import difflib
from typing import Iterable


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


def close_match(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` most likely meant: the same name spelt with dashes for
    underscores (TorchRec's ``--batch_size``) or in another case, else the closest by
    :func:`difflib.get_close_matches`; None when nothing is close."""
    known = list(known)
    by_normal = {_normal(k): k for k in known}
    if _normal(name) in by_normal:
        return by_normal[_normal(name)]
    matches = difflib.get_close_matches(_normal(name), list(by_normal), n=1, cutoff=0.75)
    return by_normal[matches[0]] if matches else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for :func:`close_match`'s X, or ``""``."""
    match = close_match(name, known)
    return f" (did you mean {match}?)" if match else ""
