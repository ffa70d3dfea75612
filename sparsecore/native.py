"""The compiled preprocessing extension (``sparsecore/csrc/preprocess.cc``), built on first use.

The first ``extension()`` call in a fresh environment compiles the source with the system C++
compiler (``$CXX``, default ``g++``; a few seconds) into a cache keyed by the source, the flags
and the Python ABI, and loads it; later processes load the cached module. Concurrent first calls
(e.g. several ranks) build once: a file lock serialises them and the module is moved into place
atomically, with a record its later loads are checked against (a damaged copy is rebuilt). When no
compiler is found or the build fails or times out (``TORCHREC_TPU_NATIVE_BUILD_TIMEOUT``),
``extension()`` warns once and returns None, and preprocessing falls back to the numpy path
(``sparsecore.preprocess``).

Environment: ``TORCHREC_TPU_NATIVE=0`` disables the extension. The build and its cache are
:mod:`xla_cache.native_build`'s (``TORCHREC_TPU_NATIVE_CACHE``; a folder no one else can write to,
else the extension is unavailable: numpy path, one warning naming why).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

from tpu_facts import knobs
from xla_cache.native_build import NativeUnavailable, build_library

SOURCE = Path(__file__).with_name("csrc") / "preprocess.cc"
MODULE = "_sparsecore_native"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-pthread", "-fvisibility=hidden")


def extension() -> ModuleType | None:
    """The loaded extension, or None (with one warning per process) when it is unavailable."""
    loaded = _load()
    if isinstance(loaded, NativeUnavailable):
        if knobs.NATIVE.on():
            _warn_once(str(loaded))
        return None
    return loaded


def require_extension() -> ModuleType:
    """The loaded extension; raises NativeUnavailable saying why it is not."""
    loaded = _load()
    if isinstance(loaded, NativeUnavailable):
        raise loaded
    return loaded


@functools.cache
def _load() -> ModuleType | NativeUnavailable:
    """Build (if needed) and load once per process; a failure is remembered, not retried."""
    try:
        return _build_and_load()
    except NativeUnavailable as error:
        return error


def _build_and_load() -> ModuleType:
    if not knobs.NATIVE.on():
        raise NativeUnavailable(f"the compiled preprocessing is disabled ({knobs.NATIVE.name}=0)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeUnavailable(f"Python headers not found in {include} (install the python3-dev package)")
    path = build_library(SOURCE, MODULE, (*FLAGS, f"-I{include}"), sysconfig.get_config_var("EXT_SUFFIX"))
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)  # loads the library: a damaged one fails here
        loader.exec_module(module)
    except ImportError as error:
        raise NativeUnavailable(f"loading {path} failed: {error}") from error
    return module


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"sparsecore: compiled preprocessing unavailable, using the numpy path: {reason}",
                  RuntimeWarning, stacklevel=3)
