"""``sparsecore``'s exported names load lazily; importing a submodule first (``sparsecore.preprocess``
is both a module and a function) must not change what they are."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_export_is_the_named_object_after_its_submodules_were_imported():
    script = """
import importlib, types
import sparsecore
for name in sparsecore.__all__:
    importlib.import_module(sparsecore._EXPORTS[name])
from sparsecore import preprocess
assert isinstance(preprocess, types.FunctionType), preprocess
bad = [n for n in sparsecore.__all__ if isinstance(getattr(sparsecore, n), types.ModuleType)]
assert not bad, bad
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
