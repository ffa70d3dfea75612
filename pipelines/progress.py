"""The jobs' progress bars: tqdm on a terminal only.

``disable=None`` is tqdm's "no bar unless the output is a terminal": a log redirected to a file gets
no carriage-return redraws (the jobs log a plain line now and then instead).
"""

from __future__ import annotations

from typing import Any


def progress_bar(iterable: Any = None, *, enabled: bool = True, **kwargs: Any) -> Any:
    """``tqdm(iterable, **kwargs)``, shown when ``enabled`` and stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(iterable, disable=None if enabled else True, **kwargs)
