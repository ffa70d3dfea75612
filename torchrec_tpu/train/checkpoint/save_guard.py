"""A checkpoint save that Ctrl-C or a full disk cannot leave half done or report as a traceback.

* Ctrl-C (SIGINT) during a save is held until the save is complete and published, then raised as
  ``KeyboardInterrupt`` (the CLI: rc 130, one line): the newest checkpoint is a whole one. A
  second Ctrl-C abandons the save at once; its directory is removed, ``latest`` stays on the
  previous checkpoint. Without the hold, the interrupt lands inside the checkpoint library, which
  turns it into its own errors (``inline_container.cc ... unexpected pos``) or swallows it.
* A failed save removes its unpublished directory, so the previous checkpoints stay as they were
  and the space is free again. A full disk (``ENOSPC``, a quota, the file size limit; or any
  failure while less is free than the state needs: the checkpoint library loses the errno) is one
  ``OSError`` naming the directory, the free space and about how much the save needs.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from torchrec_tpu.train.checkpoint.dirs import is_checkpoint

_DISK_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
              errno.EFBIG: "File too large (the file size limit, ulimit -f)"}
_MB = 1 << 20


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors this rank holds in ``state`` (its shards of sharded tensors)."""
    total = 0
    for value in flatten_state_dict(state)[0].values():
        if isinstance(value, ShardedTensor):
            total += sum(shard.tensor.nbytes for shard in value.local_shards())
        elif isinstance(value, DTensor):
            total += value.to_local().nbytes
        elif isinstance(value, torch.Tensor):
            total += value.nbytes
    return total


@contextlib.contextmanager
def guarded_save(directory: Path, needed_bytes: int) -> Iterator[None]:
    """Run a save into ``directory`` (about ``needed_bytes`` in all) as the module docstring says."""
    interrupts: list[int] = []

    def on_sigint(signum: int, frame: object) -> None:
        interrupts.append(signum)
        if len(interrupts) > 1:
            raise KeyboardInterrupt

    previous = _hold_sigint(on_sigint)
    try:
        yield
    except BaseException as error:
        free = _free_bytes(directory)  # before the partial save's space is given back
        if not is_checkpoint(directory):
            shutil.rmtree(directory, ignore_errors=True)
        if interrupts or isinstance(error, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        reason = _disk_full_reason(error) or ("No space left on device" if free < needed_bytes else None)
        if reason is not None:
            raise OSError(errno.ENOSPC, f"{reason}: saving checkpoint {directory} needs about "
                                        f"{_mb(needed_bytes)}, {_mb(free)} free there (the unfinished "
                                        "save was removed; the previous checkpoints are intact)") from None
        if isinstance(error, CheckpointException):  # a BaseException holding every rank's traceback
            failure = next(iter(_failures(error)), error)
            raise RuntimeError(f"saving checkpoint {directory} failed on rank(s) {sorted(error.failures)}: "
                               f"{type(failure).__name__}: {failure}") from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if interrupts:
        raise KeyboardInterrupt


def _hold_sigint(handler: Any) -> Any:
    """Install ``handler`` for SIGINT; the previous handler, or None where signals cannot be
    handled (not the main thread) or SIGINT is ignored (then it stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):
        return None
    signal.signal(signal.SIGINT, handler)
    return previous


def _free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of ``path`` (of its nearest existing ancestor)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _failures(error: CheckpointException) -> list[BaseException]:
    return [failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()]


def _disk_full_reason(error: BaseException) -> str | None:
    """The disk-full reason of ``error``, its causes or (DCP) any rank's failure; None if none."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL:
            return _DISK_FULL[current.errno]
        if isinstance(current, CheckpointException):
            pending += _failures(current)
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


def _mb(size: int) -> str:
    return f"{size / _MB:,.1f} MB"
