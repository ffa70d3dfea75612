"""Entries are tied to their key and read only as bounded regular files, in every level (JAX's
``executables/`` too); the native extension's build cache follows the same trust policy."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_cache
from sparsecore import native
from xla_cache import entries, native_build

OTHER_UID = 4321


def _warned(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "xla_cache" and text in r.getMessage()]


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda blob: b"\x80\x04" + blob[2:], "wrong magic bytes"),
    (lambda blob: blob[:8] + (9).to_bytes(4, "little") + blob[12:], "format version 9"),
    (lambda blob: blob[:-1], "payload of 4 bytes, its header says 5"),
    (lambda blob: blob[:-1] + b"!", "digest mismatch"),
    (lambda blob: entries.encode("fx/other-key", b"hello"), "belongs to another key"),
    (lambda blob: blob[:10], "shorter than the"),
])
def test_a_bad_entry_is_a_miss_removed_with_one_warning(cache, damage, reason, caplog) -> None:
    xla_cache.store("fx", "k", b"hello")
    assert xla_cache.load("fx", "k", bytes) == b"hello"
    path = cache / "fx" / f"k{xla_cache.ENTRY_SUFFIX}"
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        assert xla_cache.load("fx", "k", bytes) is None
    assert not path.exists()
    assert len(_warned(caplog, str(path))) == 1 and reason in caplog.text, caplog.text


@pytest.mark.parametrize("level", ["compiled", "fx", "steps"])
def test_an_entry_copied_over_another_keys_name_is_a_miss(cache, level, caplog) -> None:
    xla_cache.store(level, "a", b"program a")
    xla_cache.store(level, "b", b"program b")
    shutil.copy(cache / level / f"a{xla_cache.ENTRY_SUFFIX}", cache / level / f"b{xla_cache.ENTRY_SUFFIX}")
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        assert xla_cache.load(level, "b", bytes) is None
        assert xla_cache.load(level, "a", bytes) == b"program a"
    assert len(_warned(caplog, "belongs to another key")) == 1, caplog.text


def test_an_entry_over_the_cap_is_a_miss(cache, caplog) -> None:
    path = cache / "steps" / f"big{xla_cache.ENTRY_SUFFIX}"
    path.parent.mkdir(mode=0o700)
    with open(path, "wb") as f:  # sparse: nothing is written
        f.truncate(2 << 20)
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        assert xla_cache.load("steps", "big", bytes) is None
    assert "over the size bound of 1048576 bytes" in caplog.text and not path.exists()


def test_a_failed_write_turns_the_cache_off_with_one_warning(cache, caplog) -> None:
    (cache / "fx").mkdir(mode=0o700)
    (cache / "fx" / f"k{xla_cache.ENTRY_SUFFIX}").mkdir()  # os.replace cannot put a file there
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        for _ in range(2):
            xla_cache.store("fx", "k", b"payload")
    assert len(_warned(caplog, "compile cache off: writing")) == 1, caplog.text
    assert xla_cache.cache_dir() is None and jax.config.jax_compilation_cache_dir is None


@pytest.mark.parametrize(("parent_mode", "parent_owner", "reason"), [
    (0o777, None, "writable by others without the sticky bit"),
    (0o755, (OTHER_UID, OTHER_UID), f"owned by uid {OTHER_UID}: another user could replace it"),
    # root's, shared with another group (a member renames the cache away and plants their own)
    (0o770, (0, OTHER_UID), f"writable by group gid {OTHER_UID} without the sticky bit (mode 0o770)"),
    (0o1777, None, None),  # sticky, as /tmp: others cannot rename what is ours
    (0o1770, (0, OTHER_UID), None),
])
def test_a_directory_above_that_others_control_is_refused(tmp_path, parent_mode, parent_owner, reason, caplog):
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(parent_mode)
    if parent_owner is not None:
        os.chown(parent, *parent_owner)
    previous, cap = xla_cache.cache_dir(), xla_cache._max_bytes[0]
    try:
        with caplog.at_level(logging.WARNING, logger="xla_cache"):
            xla_cache.configure(parent / "cache")
        if reason is None:
            assert xla_cache.cache_dir() == parent / "cache" and not caplog.records
        else:
            warned = _warned(caplog, "compile cache off")
            assert len(warned) == 1 and reason in warned[0] and xla_cache.cache_dir() is None, caplog.text
    finally:
        xla_cache.configure(previous, cap)


def _plant_copy(source: Path, target: Path) -> None:
    shutil.copy(source, target)


def _plant_fifo(_source: Path, target: Path) -> None:
    target.unlink()
    os.mkfifo(target)


def _plant_dev_zero(_source: Path, target: Path) -> None:
    target.unlink()
    target.symlink_to("/dev/zero")


@pytest.mark.timeout(60)  # a FIFO read blocks forever, /dev/zero reads until memory runs out
@pytest.mark.parametrize("plant", [_plant_copy, _plant_fifo, _plant_dev_zero])
def test_jax_executables_are_tied_to_their_key(cache, plant, caplog) -> None:
    """JAX names an executable's file by its key; sin's entry under cos's name is not cos."""
    level = cache / xla_cache.XLA_LEVEL
    x = np.linspace(0.0, 1.0, 8, dtype=np.float32)  # not a program: under load its compile could pass 1 s and be stored

    def run(fn):
        jax.clear_caches()  # compiled afresh: read from (or written to) the persistent cache
        with xla_cache.persistent():
            return np.asarray(jax.jit(fn).lower(x).compile()(x))

    run(jnp.sin)
    (sin_entry,) = level.glob("*-cache")
    run(jnp.cos)
    (cos_entry,) = set(level.glob("*-cache")) - {sin_entry}
    plant(sin_entry, cos_entry)
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        np.testing.assert_allclose(run(jnp.cos), np.cos(np.asarray(x)), rtol=1e-6)
    assert len(_warned(caplog, str(cos_entry))) == 1, caplog.text
    assert not cos_entry.is_symlink() and cos_entry.read_bytes()[:8] == entries.MAGIC  # compiled and stored anew


_PLANTED_MODULE = ('#include <sys/stat.h>\n'
                   '__attribute__((constructor)) static void planted(void) { mkdir("%s", 0700); }\n')


@pytest.mark.parametrize("case", ["other owner", "world-writable", "writable module", "trusted (control)"])
def test_the_native_build_cache_never_loads_a_planted_module(case, tmp_path, monkeypatch) -> None:
    """The extension is loaded as code: a module planted where it is looked for never runs."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text(_PLANTED_MODULE % marker)
    module = tmp_path / "planted.so"
    subprocess.run([compiler, "-x", "c", "-shared", "-fPIC", str(source), "-o", str(module)], check=True)
    configured, temp = tmp_path / "native", tmp_path / "tmp"
    fallback = temp / f"torchrec-tpu-native-{os.getuid()}"
    monkeypatch.setenv("TORCHREC_TPU_NATIVE_CACHE", str(configured))
    monkeypatch.setenv("TORCHREC_TPU_NATIVE", "1")
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    suffix = native.sysconfig.get_config_var("EXT_SUFFIX")
    flags = (*native.FLAGS, f"-I{native.sysconfig.get_paths()['include']}")
    name = native_build.library_name(native.SOURCE, native.MODULE, flags, compiler, suffix)
    key = native_build.library_key(native.SOURCE, flags, compiler, suffix)
    for directory in (configured, fallback):
        directory.mkdir(parents=True, mode=0o700)
        shutil.copy(module, directory / name)
        # with its build record: a module without one is rebuilt, so only the trust policy stops it here
        Path(f"{directory / name}{native_build.RECORD_SUFFIX}").write_text(native_build.record_text(module, key))
        if case == "other owner":
            os.chown(directory, OTHER_UID, OTHER_UID)
        elif case == "world-writable":
            directory.chmod(0o777)
        elif case == "writable module":
            (directory / name).chmod(0o666)
    expected = {"other owner": f"owned by uid {OTHER_UID}", "world-writable": "writable by group or others",
                "writable module": f"{configured / name} is writable by group or others",
                "trusted (control)": f"loading {configured / name} failed"}[case]
    with pytest.raises(native.NativeUnavailable, match=re.escape(expected)):
        native._build_and_load()
    assert marker.exists() == (case == "trusted (control)")  # the control: planted where it is looked for
