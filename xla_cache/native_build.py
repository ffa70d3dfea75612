"""Shared libraries built from the project's C++ sources on first use (the sparsecore
preprocessing extension, torch_tpu's batched-matmul kernel and host hooks), cached per user.

:func:`build_library` compiles a source with the system C++ compiler (``$CXX``, default ``g++``)
into a cache keyed by the source, the flags, the compiler and the file suffix; concurrent builders
(several ranks) build once: a file lock serialises them and the library is moved into place
atomically. The cache folder is ``TORCHREC_TPU_NATIVE_CACHE`` (:mod:`tpu_facts.knobs`; default
``$XDG_CACHE_HOME/torchrec-tpu/native``, else ``~/.cache/...``). A built library runs as code, so
the folder is used only when this user owns it and no one else can write to it
(:mod:`xla_cache.trust`; created ``0700``), else a per-user folder in the temp folder under the
same rule, else :class:`NativeUnavailable` names why.

Each library has a record beside it (``<library>.record``: its cache key, size and sha256), both
fsynced before they are renamed into place; every load checks the library against its record
first, so a truncated copy (an interrupted copy of the cache, a crash before the data reached the
disk) or another library at its name is rebuilt, with one log line, never mapped. A build says it
is building on stderr and is bounded by ``TORCHREC_TPU_NATIVE_BUILD_TIMEOUT`` seconds; a compiler
that does not finish in time is killed and the library is unavailable (the caller's fallback),
as are this process' later builds with that compiler.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tpu_facts import knobs
from xla_cache import trust

RECORD_SUFFIX = ".record"
_FIRST_USE = "first use"
_RECORD_MAX_BYTES = 4096
_log = logging.getLogger("xla_cache")
_timed_out: dict[str, str] = {}  # compiler -> why it is not run again in this process


class NativeUnavailable(RuntimeError):
    """A native library could not be built or loaded (the message says why)."""


def build_timeout() -> float:
    """Seconds one build may take (``TORCHREC_TPU_NATIVE_BUILD_TIMEOUT``); :class:`~tpu_facts.knobs.KnobError`
    naming the value when it is out of the knob's range."""
    return knobs.NATIVE_BUILD_TIMEOUT.number()


def build_library(source: Path, name: str, flags: Sequence[str], suffix: str) -> Path:
    """The shared library built from ``source`` with ``flags`` by the system C++ compiler: compiled
    into the cache once per (source, flags, compiler, suffix), concurrent builders serialised, and
    its path returned, checked by the trust policy (:func:`_check_module`: it is loaded as code)
    and against its record (rebuilt when they differ). Raises NativeUnavailable saying why when no
    compiler is there, the build fails or times out or the built file is not trusted."""
    timeout = build_timeout()
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise NativeUnavailable(f"no C++ compiler {os.environ.get('CXX', 'g++')!r} on PATH")
    key = library_key(source, flags, compiler, suffix)
    path = _cache_dir() / library_name(source, name, flags, compiler, suffix)
    if _problem(path, key) is not None:
        _build(compiler, source, flags, path, key, timeout)
    _check_module(path)
    return path


def register_cpu_ffi_targets(source: Path, name: str, flags: Sequence[str], targets: Sequence[str]):
    """Build ``source`` (with jaxlib's FFI headers) into the shared library ``name``, load it,
    register each of ``targets`` (a handler symbol of that name) as an XLA:CPU FFI target and return
    the loaded library (a ``ctypes.CDLL``). Raises NativeUnavailable or OSError saying why not."""
    import ctypes

    import jax
    import jaxlib

    # the jaxlib version in the flags: its FFI headers are part of what the library was built from
    flags = (*flags, f"-I{jax.ffi.include_dir()}", f"-DJAXLIB_VERSION={jaxlib.__version__}")
    library = ctypes.CDLL(str(build_library(source, name, flags, ".so")))
    for target in targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    return library


def library_name(source: Path, name: str, flags: Sequence[str], compiler: str, suffix: str) -> str:
    """The file name the library built from ``source`` with ``flags`` by ``compiler`` has in the cache."""
    return f"{name}-{library_key(source, flags, compiler, suffix)[:16]}{suffix}"


def record_text(library: Path, key: str) -> str:
    """The record of ``library`` built for cache ``key`` (its size and sha256), as stored beside it."""
    size, digest = _size_and_digest(library)
    return json.dumps({"key": key, "size": size, "sha256": digest})


def library_key(source: Path, flags: Sequence[str], compiler: str, suffix: str) -> str:
    """The cache key (a sha256 in hex) of the library built from ``source`` with ``flags`` by ``compiler``."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(repr((tuple(flags), compiler, suffix)).encode())
    return digest.hexdigest()


def _cache_dir() -> Path:
    """The build cache: the configured (or default) folder, else a per-user one under the temp
    folder, whichever the trust policy admits (:mod:`xla_cache.trust`: the module built there is
    loaded as code)."""
    configured = knobs.NATIVE_CACHE.value()
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


def _size_and_digest(path: Path) -> tuple[int, str]:
    with open(path, "rb") as file:
        return os.fstat(file.fileno()).st_size, hashlib.file_digest(file, "sha256").hexdigest()


def _problem(path: Path, key: str) -> str | None:
    """Why the library at ``path`` is not the one built for ``key`` (:data:`_FIRST_USE` when there
    is none); None when it matches its record. The trust policy is checked first (it is not read
    unless trusted)."""
    if not os.path.lexists(path):
        return _FIRST_USE
    _check_module(path)
    try:
        with open(f"{path}{RECORD_SUFFIX}", "rb") as file:
            record = json.loads(file.read(_RECORD_MAX_BYTES))
        recorded = (str(record["key"]), int(record["size"]), str(record["sha256"]))
    except FileNotFoundError:
        return "has no record of its build"
    except (OSError, ValueError, TypeError, KeyError) as error:
        return f"has an unreadable build record ({type(error).__name__}: {error})"
    if recorded[0] != key:
        return "is recorded as built from another source or flags"
    size, digest = _size_and_digest(path)
    if size != recorded[1]:
        return f"is {size} bytes, its build recorded {recorded[1]} (a truncated copy or another file)"
    if digest != recorded[2]:
        return "differs from its build (sha256 mismatch)"
    return None


def _build(compiler: str, source: Path, flags: Sequence[str], path: Path, key: str, timeout: float) -> None:
    """Build ``source`` into ``path`` unless another process did meanwhile (the lock serialises them)."""
    with open(path.with_suffix(".lock"), "w") as lock:
        _lock(lock, path, timeout)
        problem = _problem(path, key)
        if problem is None:
            return  # built (or repaired) by another process meanwhile
        if compiler in _timed_out:
            raise NativeUnavailable(_timed_out[compiler])
        if problem == _FIRST_USE:
            print(f"torchrec-tpu: building {path.name} from {source.name} (first use; at most {timeout:g} s, "
                  f"{knobs.NATIVE_BUILD_TIMEOUT.name})", file=sys.stderr, flush=True)
        else:
            _log.warning("%s %s: rebuilding it from %s (at most %g s)", path, problem, source.name, timeout)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            _compile([compiler, *flags, str(source), "-o", str(tmp)], source, timeout)
            _install(tmp, path, key)
        finally:
            tmp.unlink(missing_ok=True)


def _lock(lock, path: Path, timeout: float) -> None:
    """Take ``lock`` (exclusive); another builder holds it at most one build's time."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise NativeUnavailable(f"another process has been building {path.name} for over {timeout:g} s "
                                        f"({knobs.NATIVE_BUILD_TIMEOUT.name})") from None
            time.sleep(0.1)


def _compile(command: list[str], source: Path, timeout: float) -> None:
    """Run the compiler; on timeout kill it and all it started (its own process group)."""
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
    except OSError as error:
        raise NativeUnavailable(f"building {source.name} failed: {error}") from error
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        why = (f"building {source.name} with {command[0]} did not finish within {timeout:g} s "
               f"({knobs.NATIVE_BUILD_TIMEOUT.name}); no further builds with it in this process")
        _timed_out[command[0]] = why
        raise NativeUnavailable(why) from None
    if process.returncode != 0:
        raise NativeUnavailable(f"building {source.name} failed ({' '.join(command)}):\n{stderr[-2000:]}")


def _install(tmp: Path, path: Path, key: str) -> None:
    """Move the built ``tmp`` to ``path`` with its record, each on disk before its rename: the
    record first, so a library in place always has its own record or is rebuilt."""
    record = Path(f"{path}{RECORD_SUFFIX}")
    record_tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    with open(tmp, "rb") as library:
        os.fsync(library.fileno())
    try:
        with open(record_tmp, "w") as file:
            file.write(record_text(tmp, key))
            file.flush()
            os.fsync(file.fileno())
        os.replace(record_tmp, record)
    finally:
        record_tmp.unlink(missing_ok=True)
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)  # the renames on disk too
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
