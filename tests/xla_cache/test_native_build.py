"""Native libraries that heal: a library in the build cache is checked against its build record
before it is loaded (a truncated copy or another library at its name is rebuilt with one log line,
never mapped), and a build is announced and bounded (a compiler that never returns is killed, the
caller falls back). Each case runs in a fresh process with its own cache folder."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpu_facts.knobs import KnobError
from xla_cache import native_build

REPO_ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("-shared", "-fPIC")
ANSWER = 'extern "C" int answer(void) { return 42; }\n'
OTHER = 'extern "C" int other(void) { return 7; }\n'
# the library built (or taken from the cache), loaded and its symbol sys.argv[2] called, as the project's
# kernels are loaded (a symbol looked up by name): its path, then what the symbol returned
BUILD = """
import ctypes, sys
from pathlib import Path
from xla_cache import native_build
path = native_build.build_library(Path(sys.argv[1]), "tiny", {flags!r}, ".so")
print(path)
print(getattr(ctypes.CDLL(str(path)), sys.argv[2])())
"""

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")


def _run(tmp_path: Path, script: str, source: Path, symbol: str = "answer", **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "TORCHREC_TPU_NATIVE_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run([sys.executable, "-c", script.format(flags=FLAGS), str(source), symbol], capture_output=True,
                          text=True, timeout=300, env=environment, cwd=REPO_ROOT)


def _source(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _built(tmp_path: Path, source: Path, symbol: str = "answer") -> Path:
    done = _run(tmp_path, BUILD, source, symbol)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.split()[0])
    assert done.stderr.splitlines() == [f"torchrec-tpu: building {path.name} from {source.name} "
                                        f"(first use; at most 300 s, TORCHREC_TPU_NATIVE_BUILD_TIMEOUT)"]
    return path


@pytest.mark.parametrize("keep", [1000, 0.5])
def test_a_truncated_library_is_rebuilt_not_mapped(tmp_path, keep) -> None:
    """Before the record, the truncated library was mapped: SIGBUS in every later process."""
    source = _source(tmp_path, "answer.cc", ANSWER)
    library = _built(tmp_path, source)
    size = library.stat().st_size
    kept = keep if isinstance(keep, int) else int(size * keep)
    os.truncate(library, kept)
    done = _run(tmp_path, BUILD, source)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == [str(library), "42"]
    assert done.stderr.splitlines() == [f"{library} is {kept} bytes, its build recorded {size} (a truncated copy "
                                        f"or another file): rebuilding it from answer.cc (at most 300 s)"]
    assert library.stat().st_size == size
    assert _run(tmp_path, BUILD, source).stderr == ""  # healed: later processes load it silently


def test_a_library_damaged_in_place_is_rebuilt(tmp_path) -> None:
    source = _source(tmp_path, "answer.cc", ANSWER)
    library = _built(tmp_path, source)
    blob = bytearray(library.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    library.write_bytes(bytes(blob))
    done = _run(tmp_path, BUILD, source)
    assert (done.returncode, done.stdout.split()) == (0, [str(library), "42"]), done.stderr
    assert done.stderr.splitlines() == [f"{library} differs from its build (sha256 mismatch): rebuilding it from "
                                        "answer.cc (at most 300 s)"]


@pytest.mark.parametrize("with_record", [False, True])
def test_another_library_at_the_cached_name_is_rebuilt(tmp_path, with_record) -> None:
    """Another library of this user's at the cached name (with or without its own record): before
    the record, the symbol lookup (as register_cpu_ffi_targets') failed with a raw AttributeError."""
    source = _source(tmp_path, "answer.cc", ANSWER)
    library = _built(tmp_path, source)
    size = library.stat().st_size
    other = _built(tmp_path, _source(tmp_path, "other.cc", OTHER), "other")
    shutil.copy(other, library)
    if with_record:
        shutil.copy(f"{other}{native_build.RECORD_SUFFIX}", f"{library}{native_build.RECORD_SUFFIX}")
    reason = ("is recorded as built from another source or flags" if with_record else
              f"is {other.stat().st_size} bytes, its build recorded {size} (a truncated copy or another file)")
    done = _run(tmp_path, BUILD, source)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(library), "42"]
    assert done.stderr.splitlines() == [f"{library} {reason}: rebuilding it from answer.cc (at most 300 s)"]


def test_a_library_without_a_record_is_rebuilt(tmp_path) -> None:
    source = _source(tmp_path, "answer.cc", ANSWER)
    library = _built(tmp_path, source)
    Path(f"{library}{native_build.RECORD_SUFFIX}").unlink()
    done = _run(tmp_path, BUILD, source)
    assert (done.returncode, done.stdout.split()) == (0, [str(library), "42"]), done.stderr
    assert done.stderr.splitlines() == [f"{library} has no record of its build: rebuilding it from answer.cc "
                                        "(at most 300 s)"]


def test_the_record_matches_the_library_it_names(tmp_path) -> None:
    source = _source(tmp_path, "answer.cc", ANSWER)
    library = _built(tmp_path, source)
    record = json.loads(Path(f"{library}{native_build.RECORD_SUFFIX}").read_text())
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    expected_key = hashlib.sha256(ANSWER.encode() + repr((FLAGS, compiler, ".so")).encode()).hexdigest()
    assert record == {"key": expected_key, "size": library.stat().st_size,
                      "sha256": hashlib.sha256(library.read_bytes()).hexdigest()}
    assert library.name == f"tiny-{expected_key[:16]}.so"


def _hanging_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A ``CXX`` that starts a child which never returns (as cc1plus may), its pid in a file."""
    pid_file = tmp_path / "compiler-child.pid"
    script = tmp_path / "hanging-cxx"
    script.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {pid_file}\nwait\n")
    script.chmod(0o755)
    return script, pid_file


def _gone(pid: int) -> bool:
    """The process exited (or is a zombie no one reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_a_compiler_that_never_returns_is_killed_after_the_timeout(tmp_path) -> None:
    source = _source(tmp_path, "answer.cc", ANSWER)
    compiler, pid_file = _hanging_compiler(tmp_path)
    script = ("import sys\nfrom pathlib import Path\nfrom xla_cache import native_build\n"
              "for name in ('tiny', 'second'):\n"
              "    try:\n        native_build.build_library(Path(sys.argv[1]), name, (), '.so')\n"
              "    except native_build.NativeUnavailable as error:\n        print(name + ': ' + str(error))\n")
    start = time.monotonic()
    done = _run(tmp_path, script, source, CXX=str(compiler), TORCHREC_TPU_NATIVE_BUILD_TIMEOUT="1")
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    why = (f"building answer.cc with {compiler} did not finish within 1 s (TORCHREC_TPU_NATIVE_BUILD_TIMEOUT); "
           "no further builds with it in this process")
    assert done.stdout.splitlines() == [f"tiny: {why}", f"second: {why}"]  # the second is not started
    assert len(done.stderr.splitlines()) == 1 and "(first use; at most 1 s" in done.stderr, done.stderr
    assert elapsed < 60
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), "the compiler's child outlived the timeout"
    assert not any(p.name.endswith(".so") for p in (tmp_path / "cache").iterdir())


@pytest.mark.slow
def test_import_torch_tpu_with_a_hanging_compiler_falls_back_with_warnings(tmp_path) -> None:
    """The host hooks are built at import: a compiler that never returns costs one timeout, then the
    kernels use XLA's path (one warning each), and results are right."""
    compiler, _ = _hanging_compiler(tmp_path)
    script = ("import warnings\nwarnings.simplefilter('always')\nimport torch, torch_tpu\n"
              "a = torch.arange(24.).reshape(2, 3, 4)\nb = torch.arange(40.).reshape(2, 4, 5)\n"
              "print(torch.equal(torch.bmm(a.to('tpu'), b.to('tpu')).cpu(), torch.bmm(a, b)))\n")
    start = time.monotonic()
    done = _run(tmp_path, script, tmp_path, CXX=str(compiler), TORCHREC_TPU_NATIVE_BUILD_TIMEOUT="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
    assert time.monotonic() - start < 120
    lines = done.stderr.splitlines()
    assert sum("building _torch_tpu_host_hooks" in line for line in lines) == 1, done.stderr
    assert sum("no pinned host memory" in line for line in lines) == 1, done.stderr
    assert sum("batched-matmul kernel is unavailable" in line for line in lines) == 1, done.stderr


@pytest.mark.parametrize("value", ["abc", "0", "0.5", "-5", "nan", "inf", "86401", ""])
def test_the_build_timeout_knob_is_validated(monkeypatch, tmp_path, value) -> None:
    monkeypatch.setenv("TORCHREC_TPU_NATIVE_BUILD_TIMEOUT", value)
    if value == "":  # empty: the default
        assert native_build.build_timeout() == 300
        return
    with pytest.raises(KnobError) as error:
        native_build.build_library(_source(tmp_path, "answer.cc", ANSWER), "tiny", FLAGS, ".so")
    assert str(error.value) == f"TORCHREC_TPU_NATIVE_BUILD_TIMEOUT={value!r}: expected a number in [1, 86400]"


def test_a_fractional_build_timeout_is_taken(monkeypatch) -> None:
    monkeypatch.setenv("TORCHREC_TPU_NATIVE_BUILD_TIMEOUT", "2.5")
    assert math.isclose(native_build.build_timeout(), 2.5)


@pytest.mark.slow
def test_import_torch_tpu_refuses_a_bad_build_timeout_in_one_line(tmp_path) -> None:
    done = _run(tmp_path, "import torch_tpu", tmp_path, TORCHREC_TPU_NATIVE_BUILD_TIMEOUT="soon")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["torch_tpu: error: TORCHREC_TPU_NATIVE_BUILD_TIMEOUT='soon': expected a number "
                                        "in [1, 86400]"]


def test_the_library_and_its_record_are_on_disk_before_their_renames(tmp_path, monkeypatch) -> None:
    """A crash after a rename must not leave a library whose bytes never reached the disk."""
    monkeypatch.setenv("TORCHREC_TPU_NATIVE_CACHE", str(tmp_path / "cache"))
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        fsync(fd)

    def recording_replace(src, dst) -> None:
        events.append(("rename", f"{Path(src).name} -> {Path(dst).name}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    library = native_build.build_library(_source(tmp_path, "answer.cc", ANSWER), "tiny", FLAGS, ".so")
    record = f"{library.name}{native_build.RECORD_SUFFIX}"
    pid = os.getpid()
    assert events == [("fsync", f".{library.name}.{pid}.tmp"), ("fsync", f".{record}.{pid}.tmp"),
                      ("rename", f".{record}.{pid}.tmp -> {record}"),
                      ("rename", f".{library.name}.{pid}.tmp -> {library.name}"), ("fsync", "cache")]
