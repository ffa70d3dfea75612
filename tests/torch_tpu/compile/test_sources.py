"""Cache keys name source files by identity (torch_tpu.compile.program.sources): any rewrite of a file,
even one of the same size whose modification time is set back, changes the identity of the file
and of the tree holding it; bytecode caches and other files do not count."""

from __future__ import annotations

import os
import time

from torch_tpu.compile.program.sources import file_identity, tree_identity


def _rewrite_keeping_size_and_mtime(path, text: str) -> None:
    before = os.stat(path)
    time.sleep(0.05)  # past the clock tick of the first write
    path.write_text(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as cp -p or tar would


def test_a_rewrite_changes_the_identity_even_with_size_and_mtime_kept(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("SCALE = 2\n")
    first, tree = file_identity(module), tree_identity(tmp_path)
    assert file_identity(module) == first and tree_identity(tmp_path) == tree  # stable while untouched
    _rewrite_keeping_size_and_mtime(module, "SCALE = 3\n")
    assert os.stat(module).st_size == len("SCALE = 2\n")
    assert file_identity(module) != first and tree_identity(tmp_path) != tree


def test_tree_counts_python_sources_only(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    tree = tree_identity(tmp_path)
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.py").write_text("stale copy\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    assert tree_identity(tmp_path) == tree
    (tmp_path / "pkg" / "b.py").write_text("y = 2\n")
    assert tree_identity(tmp_path) != tree


def test_a_missing_file_is_named():
    assert file_identity("/nonexistent/x.py") == "missing:/nonexistent/x.py"
    assert file_identity(None) == ""
