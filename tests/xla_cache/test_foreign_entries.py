"""No entry another user could have written is ever loaded: a cache directory renamed away and
replaced after it was checked is not followed (the job keeps the directory it checked), and an
entry that is a hard link, another user's, or writable by group or others is a miss with one
warning per process. The forged entries carry a valid header, key and digest: only where the file
came from tells them apart. Results are compared with the functions' own values (NumPy)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_cache
from xla_cache import entries

OTHER_UID = 4321
X = np.linspace(-3.0, 3.0, 8, dtype=np.float32)


def _sigmoid(x: jax.Array) -> jax.Array:
    return 1 / (1 + jnp.exp(-x))


def _relu(x: jax.Array) -> jax.Array:
    return jnp.maximum(x, 0)


SIGMOID = 1 / (1 + np.exp(-X))


def _run(fn: Callable[[jax.Array], jax.Array]) -> np.ndarray:
    jax.clear_caches()  # compiled afresh: read from (or written to) the persistent cache
    with xla_cache.persistent():
        return np.asarray(jax.jit(fn).lower(X).compile()(X))


def _key(entry: Path) -> str:
    return f"{xla_cache.XLA_LEVEL}/{entry.name.removesuffix('-cache')}"


def _sigmoid_and_forged(level: Path) -> tuple[Path, bytes]:
    """Sigmoid's and relu's executables compiled into ``level``: sigmoid's entry, and relu's
    executable behind a valid header for sigmoid's key (what a writer who knows the format plants)."""
    _run(_sigmoid)
    (sigmoid,) = level.glob("*-cache")
    _run(_relu)
    (relu,) = set(level.glob("*-cache")) - {sigmoid}
    return sigmoid, entries.encode(_key(sigmoid), entries.decode(_key(relu), relu.read_bytes()))


def _warned(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "xla_cache" and text in r.getMessage()]


def _write(path: Path, blob: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.chmod(path, mode)


def test_a_cache_swapped_after_the_check_is_never_followed(cache: Path, tmp_path: Path, caplog) -> None:
    sigmoid, forged = _sigmoid_and_forged(cache / xla_cache.XLA_LEVEL)
    checked = tmp_path / "checked"
    cache.rename(checked)  # the directory the job checked goes away; another user's takes its place
    planted = cache / xla_cache.XLA_LEVEL / sigmoid.name
    planted.parent.mkdir(parents=True, mode=0o700)
    _write(planted, forged)
    for path in (cache, planted.parent, planted):
        os.chown(path, OTHER_UID, OTHER_UID)
    used = checked / xla_cache.XLA_LEVEL / sigmoid.name.replace("-cache", "-atime")  # JAX's LRU stamp
    stamp = int.from_bytes(used.read_bytes(), "little")
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        np.testing.assert_allclose(_run(_sigmoid), SIGMOID, rtol=1e-6)  # relu's output before
        _run(jnp.tanh)
    assert int.from_bytes(used.read_bytes(), "little") > stamp  # sigmoid's own entry, read (a hit) where it was checked
    assert len(list((checked / xla_cache.XLA_LEVEL).glob("*-cache"))) == 3  # tanh stored there too
    assert list(planted.parent.iterdir()) == [planted] and not caplog.records, caplog.text


def _hard_link(path: Path, forged: bytes, elsewhere: Path) -> str:
    _write(elsewhere, forged)  # a file of this user's, but with a second name outside the cache
    path.unlink()
    os.link(elsewhere, path)
    return "2 hard links"


def _other_owner(path: Path, forged: bytes, _elsewhere: Path) -> str:
    _write(path, forged)
    os.chown(path, OTHER_UID, OTHER_UID)
    return f"owned by uid {OTHER_UID}"


def _group_writable(path: Path, forged: bytes, _elsewhere: Path) -> str:
    _write(path, forged, 0o660)
    return "writable by group or others, mode 0o660"


def _others_hard_link(path: Path, forged: bytes, elsewhere: Path) -> str:
    """The issue's case: a hard link to another user's world-writable file holding a forged entry."""
    _write(elsewhere, forged, 0o666)
    os.chown(elsewhere, OTHER_UID, OTHER_UID)
    path.unlink()
    os.link(elsewhere, path)
    return f"owned by uid {OTHER_UID}"


FOREIGN = {"hard link": _hard_link, "other owner": _other_owner, "group-writable": _group_writable,
           "another user's file, hard-linked": _others_hard_link}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_foreign_jax_executable_is_a_miss(cache: Path, tmp_path: Path, case: str, caplog) -> None:
    sigmoid, forged = _sigmoid_and_forged(cache / xla_cache.XLA_LEVEL)
    reason = FOREIGN[case](sigmoid, forged, tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        np.testing.assert_allclose(_run(_sigmoid), SIGMOID, rtol=1e-6)
    warned = _warned(caplog, f"{sigmoid} is not this user's own ({reason})")
    assert len(warned) == 1 and len(caplog.records) == 1, caplog.text
    st = os.lstat(sigmoid)  # compiled and stored anew, this user's alone
    assert (st.st_uid, st.st_nlink, st.st_mode & 0o077) == (os.getuid(), 1, 0)
    assert (tmp_path / "elsewhere").exists() == ("hard" in case)  # the other name is left alone


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_foreign_entry_of_a_level_is_a_miss(cache: Path, tmp_path: Path, case: str, caplog) -> None:
    xla_cache.store("compiled", "k", b"genuine")
    path = cache / "compiled" / f"k{xla_cache.ENTRY_SUFFIX}"
    reason = FOREIGN[case](path, entries.encode("compiled/k", b"forged"), tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        assert xla_cache.load("compiled", "k", bytes) is None
    assert len(_warned(caplog, f"{path} is not this user's own ({reason})")) == 1, caplog.text
    assert not path.exists()
    xla_cache.store("compiled", "k", b"genuine")
    assert xla_cache.load("compiled", "k", bytes) == b"genuine"


def test_foreign_entries_warn_once_per_process(cache: Path, tmp_path: Path, caplog) -> None:
    for i, case in enumerate(sorted(FOREIGN)):
        xla_cache.store("fx", f"k{i}", b"genuine")
        FOREIGN[case](cache / "fx" / f"k{i}{xla_cache.ENTRY_SUFFIX}", entries.encode(f"fx/k{i}", b"forged"),
                      tmp_path / f"elsewhere{i}")
    with caplog.at_level(logging.WARNING, logger="xla_cache"):
        assert [xla_cache.load("fx", f"k{i}", bytes) for i in range(len(FOREIGN))] == [None] * len(FOREIGN)
    assert len(caplog.records) == 1 and "is not this user's own" in caplog.text, caplog.text
