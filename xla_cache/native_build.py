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
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tpu_facts import knobs
from xla_cache import trust

BUILD_TIMEOUT_S = 600


class NativeUnavailable(RuntimeError):
    """A native library could not be built or loaded (the message says why)."""


def build_library(source: Path, name: str, flags: Sequence[str], suffix: str) -> Path:
    """The shared library built from ``source`` with ``flags`` by the system C++ compiler: compiled
    into the cache once per (source, flags, compiler, suffix), concurrent builders serialised, and
    its path returned, checked by the trust policy (:func:`_check_module`: it is loaded as code).
    Raises NativeUnavailable saying why when no compiler is there, the build fails or the built
    file is not trusted."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise NativeUnavailable(f"no C++ compiler {os.environ.get('CXX', 'g++')!r} on PATH")
    path = _cache_dir() / library_name(source, name, flags, compiler, suffix)
    if not os.path.lexists(path):
        _build(compiler, source, flags, path)
    _check_module(path)
    return path


def register_cpu_ffi_targets(source: Path, name: str, flags: Sequence[str], targets: Sequence[str]) -> None:
    """Build ``source`` (with jaxlib's FFI headers) into the shared library ``name``, load it and
    register each of ``targets`` (a handler symbol of that name) as an XLA:CPU FFI target. Raises
    NativeUnavailable or OSError saying why not."""
    import ctypes

    import jax
    import jaxlib

    # the jaxlib version in the flags: its FFI headers are part of what the library was built from
    flags = (*flags, f"-I{jax.ffi.include_dir()}", f"-DJAXLIB_VERSION={jaxlib.__version__}")
    library = ctypes.CDLL(str(build_library(source, name, flags, ".so")))
    for target in targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")


def library_name(source: Path, name: str, flags: Sequence[str], compiler: str, suffix: str) -> str:
    """The file name the library built from ``source`` with ``flags`` by ``compiler`` has in the cache."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(repr((tuple(flags), compiler, suffix)).encode())
    return f"{name}-{digest.hexdigest()[:16]}{suffix}"


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
