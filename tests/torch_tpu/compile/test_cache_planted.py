"""What is planted in the persistent compile cache never runs and never changes a result: a pickle
over an entry of ``compiled/``, ``fx/`` or ``steps/``, an entry copied over another key's name
(relu's program under sigmoid's key), a FIFO or a symbolic link to /dev/zero, a bit-flipped step
program, and a cache directory the trust policy refuses (another owner, world-writable, read-only,
a file, a symbolic-link level). Each is a miss with one warning; results match CPU torch."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import torch

import torch_tpu.compile as tc
import xla_cache
from tests.torch_tpu.compile.planted_child import activation_model, compile_inputs, planted_pickle, step_losses
from torch_tpu.compile.program import graph
from xla_cache import entries

REPO = Path(__file__).resolve().parents[3]
LEVELS = ("compiled", "fx", "steps")
OTHER_UID = 4321


def _files(cache: Path) -> dict[str, set[Path]]:
    return {level: set((cache / level).glob(f"*{xla_cache.ENTRY_SUFFIX}")) for level in LEVELS}


def _plant_everywhere(cache: Path, marker: Path) -> list[Path]:
    """A pickle over every entry: bare (as the old format read ``compiled/``), and over every
    other ``compiled/`` entry behind a valid header for the entry's own key (what a writer who
    knows the format would plant)."""
    blob = planted_pickle(marker)
    planted = []
    for level, paths in _files(cache).items():
        for i, path in enumerate(sorted(paths)):
            key = path.name.removesuffix(xla_cache.ENTRY_SUFFIX)
            path.write_bytes(entries.encode(f"{level}/{key}", blob) if level == "compiled" and i % 2 else blob)
            planted.append(path)
    return planted


def _compiled_output(name: str) -> torch.Tensor:
    """A fresh ``torch.compile`` of the ``name`` model (nothing reused from memory: the persistent
    cache is read)."""
    torch._dynamo.reset()
    graph._MEMORY.clear()
    with torch.no_grad():
        return torch.compile(activation_model(name), backend="tpu", dynamic=False)(compile_inputs())


def _reference(name: str) -> torch.Tensor:
    with torch.no_grad():
        return activation_model(name)(compile_inputs())


def _warned(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "xla_cache" and text in r.getMessage()]


@pytest.fixture
def cache(tmp_path: Path):
    previous = tc.cache_dir()
    tc.configure_cache(tmp_path / "cache")
    yield tmp_path / "cache"
    tc.configure_cache(previous)


def test_planted_pickles_never_run(cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _compiled_output("relu")
    losses = step_losses()
    marker = tmp_path / "planted-code-ran"
    planted = _plant_everywhere(cache, marker)
    assert {p.parent.name for p in planted} == set(LEVELS)
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        torch.testing.assert_close(_compiled_output("relu"), _reference("relu"))
        assert step_losses() == losses
    assert not marker.exists()
    for path in planted:
        assert len(_warned(caplog, str(path))) == 1, (path, caplog.text)
        assert not path.is_symlink() and path.read_bytes()[:8] == entries.MAGIC  # compiled and stored anew


@pytest.mark.parametrize("level", ["compiled", "fx"])
def test_an_entry_copied_over_another_keys_name_is_a_miss(cache: Path, level: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    _compiled_output("relu")
    relu = _files(cache)
    _compiled_output("sigmoid")
    sigmoid = {lvl: paths - relu[lvl] for lvl, paths in _files(cache).items()}
    (source,), (target,) = relu[level], sigmoid[level]
    shutil.copy(source, target)  # relu's program under sigmoid's key
    if level == "fx":
        sigmoid["compiled"].pop().unlink()  # so the translation is what gets compiled
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        torch.testing.assert_close(_compiled_output("sigmoid"), _reference("sigmoid"))
    assert len(_warned(caplog, f"{target} is corrupt (BadEntry: it belongs to another key")) == 1, caplog.text


def test_a_cache_swapped_after_the_check_is_never_followed(cache: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The cache directory renamed away under the running job and another put in its place, with
    relu's translation and executable behind valid headers for sigmoid's keys: never read."""
    _compiled_output("relu")
    relu = _files(cache)
    _compiled_output("sigmoid")
    sigmoid = {level: paths - relu[level] for level, paths in _files(cache).items()}
    forged = {}
    for level in ("compiled", "fx"):
        (source,), (target,) = relu[level], sigmoid[level]
        payload = entries.decode(f"{level}/{source.name.removesuffix(xla_cache.ENTRY_SUFFIX)}", source.read_bytes())
        forged[target.relative_to(cache)] = entries.encode(
            f"{level}/{target.name.removesuffix(xla_cache.ENTRY_SUFFIX)}", payload)
    cache.rename(tmp_path / "checked")
    for relative, blob in forged.items():
        (cache / relative).parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        (cache / relative).write_bytes(blob)
        (cache / relative).chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        torch.testing.assert_close(_compiled_output("sigmoid"), _reference("sigmoid"))  # relu's before
    assert not _warned(caplog, ""), caplog.text
    assert {p.relative_to(cache) for p in cache.rglob("*") if p.is_file()} == set(forged)  # nothing read or written


@pytest.mark.timeout(60)  # a FIFO read blocks forever, /dev/zero reads until memory runs out
def test_fifo_and_symlink_to_dev_zero_are_misses(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    _compiled_output("relu")
    losses = step_losses()
    specials = []
    for i, path in enumerate(sorted(p for paths in _files(cache).values() for p in paths)):
        path.unlink()
        if i % 2:
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero")
        specials.append(path)
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        torch.testing.assert_close(_compiled_output("relu"), _reference("relu"))
        assert step_losses() == losses
    for path in specials:
        assert len(_warned(caplog, str(path))) == 1, (path, caplog.text)
        assert path.is_file() and not path.is_symlink()  # stored anew as a regular file


def test_a_bit_flipped_step_program_is_recompiled_once(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    losses = step_losses()
    (entry,) = _files(cache)["steps"]
    blob = bytearray(entry.read_bytes())
    blob[blob.index(b"ML\xefR") + 32] ^= 0x10  # inside the StableHLO bytecode: it no longer deserializes
    entry.write_bytes(bytes(blob))
    for path in _files(cache)["compiled"]:
        path.unlink()  # the step's program itself must be read
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        assert step_losses() == losses
        assert len(_warned(caplog, f"{entry} is corrupt")) == 1, caplog.text
        caplog.clear()
        tc.reset_cache_stats()
        assert step_losses() == losses  # the later run loads what the miss stored, silently
    assert not _warned(caplog, "corrupt") and tc.cache_stats().step_disk_hits == 1


def _other_owner(path: Path) -> None:
    for p in (path, *path.rglob("*")):
        os.lchown(p, OTHER_UID, OTHER_UID)


def _world_writable_level(path: Path) -> None:
    (path / "compiled").chmod(0o777)


def _symlinked_level(path: Path) -> None:
    elsewhere = path.parent / "elsewhere"
    (path / "compiled").rename(elsewhere)
    (path / "compiled").symlink_to(elsewhere)


REFUSED = {  # how a populated cache directory is made untrusted -> what the warning says
    "other owner": (_other_owner, f"owned by uid {OTHER_UID}, not by this user"),
    "world-writable": (lambda p: p.chmod(0o777), "is writable by group or others (mode 0o777)"),
    "group-writable level": (_world_writable_level, "compiled is writable by group or others"),
    "symlinked level": (_symlinked_level, "compiled is a symbolic link"),
    "world-writable JAX level": (lambda p: (p / "executables").chmod(0o777), "executables is writable by group"),
    "read-only": (lambda p: p.chmod(0o555), "is not writable (mode 0o555"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_untrusted_directory_is_not_used(case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make_untrusted, reason = REFUSED[case]
    good, directory = tmp_path / "good", tmp_path / "cache"
    previous = tc.cache_dir()
    try:
        tc.configure_cache(good)
        _compiled_output("relu")
        shutil.copytree(good, directory, symlinks=True)
        marker = tmp_path / "planted-code-ran"
        blob = planted_pickle(marker)
        for path in _files(directory)["compiled"]:  # as the old format was read: a bare pickle
            path.write_bytes(blob)
        make_untrusted(directory)
        before = sorted(directory.rglob("*"))
        with caplog.at_level(logging.WARNING, logger="xla_cache"):
            tc.configure_cache(directory)
            torch.testing.assert_close(_compiled_output("relu"), _reference("relu"))
        warned = _warned(caplog, "compile cache off")
        assert len(warned) == 1 and reason in warned[0] and str(directory) in warned[0], caplog.text
        assert tc.cache_dir() is None and jax.config.jax_compilation_cache_dir is None
        assert not marker.exists() and sorted(directory.rglob("*")) == before
    finally:
        directory.chmod(0o700)
        tc.configure_cache(previous)


def test_a_file_as_the_cache_path_runs_uncached(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache"
    path.write_text("not a directory")
    previous = tc.cache_dir()
    try:
        with caplog.at_level(logging.WARNING, logger="xla_cache"):
            for where in (path, path / "below"):
                tc.configure_cache(where)
                torch.testing.assert_close(_compiled_output("relu"), _reference("relu"))
        warned = _warned(caplog, "compile cache off")
        assert len(warned) == 2 and "is not a directory" in warned[0] and "cannot be created" in warned[1], warned
    finally:
        tc.configure_cache(previous)


def _child(cache: Path, *args: str) -> tuple[dict, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_TPU_COMPILE_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "tests.torch_tpu.compile.planted_child", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), [
        line for line in proc.stderr.splitlines() if "compile cache" in line]


@pytest.mark.multiprocess
@pytest.mark.slow  # three fresh processes (~70 s on 2 busy cores)
def test_torch_compile_job_with_planted_entries(tmp_path: Path) -> None:
    """A real ``torch.compile(backend="tpu")`` job: bare pickles over its entries never run; a
    foreign-owned cache gives one warning line and the job runs uncached."""
    cache, marker = tmp_path / "cache", tmp_path / "planted-code-ran"
    expected = _reference("sigmoid").tolist()
    first, _ = _child(cache, "compile", "sigmoid")
    blob = planted_pickle(marker)
    for path in (*_files(cache)["compiled"], *_files(cache)["fx"]):
        path.write_bytes(blob)
    second, warned = _child(cache, "compile", "sigmoid")
    assert not marker.exists()
    assert second["cache"]["fx_misses"] == 1 and len(warned) == 2 and all("corrupt" in w for w in warned), warned
    _other_owner(cache)
    third, warned = _child(cache, "compile", "sigmoid")
    assert len(warned) == 1 and f"owned by uid {OTHER_UID}" in warned[0] and third["dir"] == "None", warned
    for result in (first, second, third):
        torch.testing.assert_close(torch.tensor(result["out"]), torch.tensor(expected))
