"""Suite-wide: every process the tests start compiles into a private persistent compile cache,
never the user's (``TORCH_TPU_COMPILE_CACHE`` is read when JAX is first used; child processes
inherit it). It is removed when the test session's process exits. Tests measured slow join ``-m slow``."""

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

if "TORCH_TPU_COMPILE_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="torchrec-tpu-test-cache-")
    os.environ["TORCH_TPU_COMPILE_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


_MEASURED_SLOW = json.loads((Path(__file__).parent / "measured_slow.json").read_text())["slow"]


@pytest.hookimpl(tryfirst=True)  # before ``-m 'not slow'`` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests measured slow (``tests/measured_slow.json``, written by ``scripts/measure_slow_tests.py``)
    join ``-m slow``. When whole files were collected, a listed parametrized test that is not
    among them (its parameters were renamed, so it would silently rejoin the default run) is an
    error; ``tests/test_measured_slow.py`` checks the test functions themselves."""
    for item in items:
        if item.nodeid in _MEASURED_SLOW:
            item.add_marker(pytest.mark.slow)
    if any("::" in str(arg) for arg in config.args):
        return  # single tests chosen: their siblings are not collected
    collected = {item.nodeid for item in items}
    functions = {node_id.partition("[")[0] for node_id in collected}
    stale = sorted(node_id for node_id in _MEASURED_SLOW
                   if "[" in node_id and node_id not in collected and node_id.partition("[")[0] in functions)
    if stale:
        raise pytest.UsageError("tests/measured_slow.json lists parametrized tests that no longer exist "
                                "(renamed parameters?): " + ", ".join(stale))


@pytest.fixture(name="strict")
def strict_fixture():
    """Zero CPU fallbacks: an unlowered op raises TpuFallbackError; counters must stay empty."""
    from torch_tpu.eager import fallback

    fallback.reset_metrics()
    with fallback.no_fallback():
        yield
    assert fallback.fallback_counts() == {}
