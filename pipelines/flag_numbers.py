"""argparse ``type``s of the numeric flags of every ``torchrec-tpu`` subcommand (the training
options, which a ``--config`` file may also set, are checked by ``TrainConfig.validate``). A bad
value is argparse's one error line naming the flag, the value and the limit::

    torchrec-tpu profile: error: argument --top: must be > 0, got -5

Floats must also be finite. (In :mod:`pipelines`, the lowest package with a CLI.)
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def _parsed(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _bounded(kind: type, ok: Callable[[float], bool], limit: str, name: str) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = _parsed(text, kind)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {limit}, got {value}")
        return value

    parse.__name__ = name
    return parse


positive_int = _bounded(int, lambda v: v > 0, "> 0", "positive_int")
non_negative_int = _bounded(int, lambda v: v >= 0, ">= 0", "non_negative_int")
positive_float = _bounded(float, lambda v: v > 0, "> 0", "positive_float")
non_negative_float = _bounded(float, lambda v: v >= 0, ">= 0", "non_negative_float")
