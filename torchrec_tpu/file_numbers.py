"""Numbers read from a user's YAML/JSON/CSV file, checked with errors naming the file and key.

YAML 1.1 reads ``1e12`` (no dot) as a string; such text is taken as the number it spells. NaN,
infinities, booleans and other text are refused, as are values under the key's minimum.
"""

from __future__ import annotations

import math
from typing import Any


def file_number(value: Any, where: str, *, integer: bool = False, minimum: float | None = None,
                positive: bool = False) -> int | float:
    """``value`` as a finite float (an int with ``integer``); ``where`` names the file and key,
    e.g. ``topo.yaml: chip.ici_bandwidth_bytes_per_s``."""
    expected = "a whole number" if integer else "a number"
    if positive:
        expected += " > 0"
    elif minimum is not None:
        expected += f" >= {minimum:g}"
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip().replace("_", ""))
        except ValueError:
            pass
    if (number is None or not math.isfinite(number) or (integer and number != int(number))
            or (positive and number <= 0) or (minimum is not None and number < minimum)):
        raise ValueError(f"{where}: expected {expected}, got {value!r}")
    if integer:
        return value if isinstance(value, int) else int(number)  # "1e6" -> 1000000
    return number
