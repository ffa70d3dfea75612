"""No job writes where it reads: every command checks its output paths (log files and directories,
checkpoint roots, profiles, predictions, converted data) against its input paths (data files and
directories, option and plan files, checkpoints) before it starts, with :func:`check_outputs_apart`.

An output may not be an input (the same path, through a link too), lie inside an input directory
(where the job's readers, or the next run's, would take it for data), or hold an input inside it
(where the job writes its own file names and could replace one; ``may_hold`` names the outputs
whose files cannot be mistaken for an input, such as a TensorBoard log directory), and two outputs
may not be one path. Paths compare resolved (``..``, symbolic links), so ``DATA/../DATA/part-0.parquet`` is
``DATA/part-0.parquet``. Pairs a job means to share (a run resuming from the checkpoint root it
writes to) are named in ``may_share``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection, Sequence, Union

PathLike = Union[str, "os.PathLike[str]"]
FlagPath = tuple[str, Union[PathLike, None]]  # (flag, the path it names; None or "": not given)


def check_outputs_apart(outputs: Sequence[FlagPath], inputs: Sequence[FlagPath],
                        may_share: Collection[tuple[str, str]] = (), may_hold: Collection[str] = ()) -> None:
    """ValueError naming both flags and the paths when an output of ``outputs`` is, lies inside or
    (unless its flag is in ``may_hold``) holds an input of ``inputs``, or is another output;
    ``may_share``: (output flag, other flag) pairs left alone."""
    given_outputs = _given(outputs)
    given_inputs = _given(inputs)
    for index, (flag, out) in enumerate(given_outputs):
        for other_flag, other in given_outputs[:index]:
            if not _shared(flag, other_flag, may_share) and _same(out, other):
                raise ValueError(f"{flag}={str(out)!r} is also {other_flag}={str(other)!r}: two outputs need two "
                                 "paths")
        for in_flag, source in given_inputs:
            if _shared(flag, in_flag, may_share):
                continue
            if _same(out, source):
                relation = "is"
            elif _inside(out, source):
                relation = "lies inside"
            elif flag not in may_hold and _inside(source, out):
                relation = "holds"
            else:
                continue
            raise ValueError(f"{flag}={str(out)!r} {relation} the input {in_flag}={str(source)!r}: an output may "
                             "not overwrite or mix with what the job reads; give it a path of its own")


def _given(paths: Sequence[FlagPath]) -> list[tuple[str, Path]]:
    return [(flag, Path(path)) for flag, path in paths if path is not None and str(path) != ""]


def _shared(flag: str, other: str, may_share: Collection[tuple[str, str]]) -> bool:
    return (flag, other) in may_share or (other, flag) in may_share


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _same(a: Path, b: Path) -> bool:
    if _resolved(a) == _resolved(b):
        return True
    try:
        return os.path.samefile(a, b)  # a hard link, or a path the resolution cannot see through
    except OSError:  # one of them does not exist (yet)
        return False


def _inside(path: Path, directory: Path) -> bool:
    """``path`` lies strictly inside ``directory`` (an existing directory)."""
    return directory.is_dir() and _resolved(directory) in _resolved(path).parents
