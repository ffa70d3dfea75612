"""Reading DCP state without running code from it, whatever the checkpoint holds.

Stock DCP unpickles ``state/.metadata`` with plain ``pickle`` and loads non-tensor values with
``torch.load(weights_only=False)``: a crafted checkpoint runs arbitrary code on load. Here the
metadata goes through an unpickler that resolves only DCP's own metadata classes and the torch
values they hold (sizes, dtypes, layouts), every storage file it names must be a plain file of the
state directory, and non-tensor values load with ``weights_only=True``. Anything else is a
:class:`CheckpointError` naming what the file asked for. Integrity (the manifest) is checked
before this, by the caller.
"""

from __future__ import annotations

import io
import pickle
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DefaultLoadPlanner's names
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from torchrec_tpu.sharding.deferred import DeferredTensor
from torchrec_tpu.train.checkpoint.manifest import CheckpointError

_METADATA_CLASSES = {name: getattr(dcp_metadata, name)
                     for name in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")}
_ALLOWED: dict[str, dict[str, Any]] = {
    "torch.distributed.checkpoint.metadata": _METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo": dcp.filesystem._StorageInfo},
    "torch.serialization": {"_get_layout": torch.serialization._get_layout},
    "torch": {"Size": torch.Size, **{name: value for name, value in vars(torch).items()
                                     if isinstance(value, (torch.dtype, torch.layout))}},
    "pathlib": {name: getattr(__import__("pathlib"), name)
                for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
    "collections": {"OrderedDict": __import__("collections").OrderedDict},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get(module, {})
        if name not in allowed:
            raise CheckpointError(
                f"{self.source} asks to load {module}.{name}, which DCP metadata never holds: "
                "refusing to unpickle it (a crafted or foreign checkpoint)"
            )
        return allowed[name]


def read_state_metadata(state_dir: Path) -> Metadata:
    """The DCP metadata of ``state_dir``, unpickled with only DCP's own types allowed."""
    path = state_dir / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as error:  # a malformed pickle: any of many exception types
        raise CheckpointError(f"{path} is not DCP metadata ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or len(PurePosixPath(name).parts) != 1 or name in ("..", "."):
            raise CheckpointError(f"{path} names storage file {name!r} outside {state_dir}")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata comes from :func:`read_state_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_state_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` loading non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"checkpoint value {read_item.dest_index.fqn!r} is not plain data: refusing to "
                f"load it ({str(error).splitlines()[0]})"
            ) from None
        # where DefaultLoadPlanner.load_bytes puts the value
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def check_shapes(state: dict[str, Any], metadata: Metadata, state_dir: Path) -> None:
    """CheckpointError naming the first tensor of ``state`` (the model and optimizer built from
    the checkpoint's ``meta.json``) that ``state_dir`` lacks or holds in another shape: a
    checkpoint whose tensors disagree with its own description is never loaded."""
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    for name, value in flat.items():
        if not isinstance(value, torch.Tensor):  # plain values (steps, lr): no shape to check
            continue
        expected = list(value.size())  # the global size of a ShardedTensor / DTensor
        entry = saved.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {state_dir.parent}: {state_dir.name}/ has no tensor {name!r} "
                                  f"(meta.json's model has it, shape {expected})")
        # a non-tensor value where a tensor belongs is left to SafeLoadPlanner: it refuses what is
        # not plain data, naming it
        if isinstance(entry, TensorStorageMetadata) and list(entry.size) != expected:
            raise CheckpointError(
                f"checkpoint {state_dir.parent}: tensor {name!r} is {list(entry.size)} in {state_dir.name}/, "
                f"meta.json's model needs {expected} (an inconsistent checkpoint: refusing to load it)")


def load_state(state: dict[str, dict[str, Any]], state_dir: Path) -> None:
    """``dcp.load(state, ...)`` from ``state_dir`` through the safe reader and planner, after
    :func:`check_shapes`. Failures on any rank raise on every rank as one CheckpointError (DCP
    reports them as a ``CheckpointException``, a BaseException with every rank's traceback).

    ``state``: state dicts by name (``{"model": ..., "optimizer": ...}``). A
    :class:`~torchrec_tpu.sharding.deferred.DeferredTensor` in them (a one-rank job's embedding
    tables, ``deferred_tables``) is not loaded now: it is replaced by one that reads that tensor
    alone from ``state_dir`` when asked, so whoever takes the tables (the sharded modules' load)
    holds one table's host copy at a time, not all of them beside the live ones."""
    check_shapes(state, read_state_metadata(state_dir), state_dir)
    for name, entries in state.items():
        for key, value in entries.items():
            if isinstance(value, DeferredTensor):
                entries[key] = DeferredTensor(tuple(value.shape), partial(_read_one, state_dir, name, key,
                                                                          tuple(value.shape)))
    now = {name: {k: v for k, v in entries.items() if not isinstance(v, DeferredTensor)}
           for name, entries in state.items()}
    _dcp_load(now, state_dir)
    for name, entries in now.items():  # (with the values the load put in place of plain ones)
        state[name].update(entries)


def _read_one(state_dir: Path, name: str, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor ``key`` of state dict ``name`` in ``state_dir``, read alone."""
    value = torch.empty(shape, dtype=torch.float32)
    _dcp_load({name: {key: value}}, state_dir)
    return value


def _dcp_load(state: dict[str, Any], state_dir: Path) -> None:
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(state_dir)), planner=SafeLoadPlanner())
    except CheckpointException as error:
        failures = [failure for failure, _ in error.failures.values()]
        ours = next((f for f in failures if isinstance(f, CheckpointError)), None)
        if ours is not None:
            raise CheckpointError(str(ours)) from None
        first = failures[0] if failures else error
        raise CheckpointError(f"loading {state_dir} failed on rank(s) {sorted(error.failures)}: "
                              f"{type(first).__name__}: {first}") from None
