"""The compiled preprocessing extension (``sparsecore/csrc/preprocess.cc``), built on first use.

The first ``extension()`` call in a fresh environment compiles the source with the system C++
compiler (``$CXX``, default ``g++``; a few seconds) into a cache keyed by the source, the flags
and the Python ABI, and loads it; later processes load the cached module. Concurrent first calls
(e.g. several ranks) build once: a file lock serialises them and the module is moved into place
atomically. When no compiler is found or the build fails, ``extension()`` warns once and returns
None, and preprocessing falls back to the numpy path (``sparsecore.preprocess``).

Environment: ``TORCHREC_TPU_NATIVE=0`` disables the extension; ``TORCHREC_TPU_NATIVE_CACHE`` sets
the cache folder (default ``$XDG_CACHE_HOME/torchrec-tpu/native``, else ``~/.cache/...``). The
built module runs as code, so the folder is used only when this user owns it and no one else can
write to it (:mod:`xla_cache.trust`; created ``0700``), else a per-user folder in the temp folder
under the same rule, else the extension is unavailable (numpy path, one warning naming why).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import stat
import subprocess
import sysconfig
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from xla_cache import trust

SOURCE = Path(__file__).with_name("csrc") / "preprocess.cc"
MODULE = "_sparsecore_native"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-pthread", "-fvisibility=hidden")
BUILD_TIMEOUT_S = 600


class NativeUnavailable(RuntimeError):
    """The compiled extension could not be built or loaded (the message says why)."""


def extension() -> ModuleType | None:
    """The loaded extension, or None (with one warning per process) when it is unavailable."""
    loaded = _load()
    if isinstance(loaded, NativeUnavailable):
        if os.environ.get("TORCHREC_TPU_NATIVE", "1") != "0":
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
    if os.environ.get("TORCHREC_TPU_NATIVE", "1") == "0":
        raise NativeUnavailable("the compiled preprocessing is disabled (TORCHREC_TPU_NATIVE=0)")
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


def build_library(source: Path, name: str, flags: Sequence[str], suffix: str) -> Path:
    """The shared library built from ``source`` with ``flags`` by the system C++ compiler: compiled
    into the cache once per (source, flags, compiler, suffix), concurrent builders serialised, and
    its path returned, checked by the trust policy (:func:`_check_module`: it is loaded as code).
    Raises NativeUnavailable saying why when no compiler is there, the build fails or the built
    file is not trusted."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise NativeUnavailable(f"no C++ compiler {os.environ.get('CXX', 'g++')!r} on PATH")
    path = _cache_dir() / f"{name}-{_build_key(source, flags, compiler, suffix)}{suffix}"
    if not os.path.lexists(path):
        _build(compiler, source, flags, path)
    _check_module(path)
    return path


def _build_key(source: Path, flags: Sequence[str], compiler: str, suffix: str) -> str:
    digest = hashlib.sha256(source.read_bytes())
    digest.update(repr((tuple(flags), compiler, suffix)).encode())
    return digest.hexdigest()[:16]


def _cache_dir() -> Path:
    """The build cache: the configured (or default) folder, else a per-user one under the temp
    folder, whichever the trust policy admits (:mod:`xla_cache.trust`: the module built there is
    loaded as code)."""
    configured = os.environ.get("TORCHREC_TPU_NATIVE_CACHE")
    if configured:
        base = Path(configured)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchrec-tpu" / "native"
    reasons = []
    for candidate in (base, Path(tempfile.gettempdir()) / f"torchrec-tpu-native-{os.getuid()}"):
        try:
            return trust.private_dir(candidate)
        except trust.Untrusted as error:
            reasons.append(str(error))
    raise NativeUnavailable(f"no trusted build cache ({'; '.join(reasons)})")


def _check_module(path: Path) -> None:
    """Refuse a built module that is not a regular file of this user's, writable by no one else."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NativeUnavailable(f"{path} is not a regular file: remove it")
    try:
        trust.check_owned(path, st, f"remove {path}")
    except trust.Untrusted as error:
        raise NativeUnavailable(str(error)) from None


def _build(compiler: str, source: Path, flags: Sequence[str], path: Path) -> None:
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same module
        if os.path.lexists(path):
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        command = [compiler, *flags, str(source), "-o", str(tmp)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise NativeUnavailable(f"building {source.name} failed: {error}") from error
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeUnavailable(f"building {source.name} failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
        os.replace(tmp, path)


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"sparsecore: compiled preprocessing unavailable, using the numpy path: {reason}",
                  RuntimeWarning, stacklevel=3)
