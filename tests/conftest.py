"""Suite-wide: every process the tests start compiles into a private persistent compile cache,
never the user's (``TORCH_TPU_COMPILE_CACHE`` is read when JAX is first used; child processes
inherit it). It is removed when the test session's process exits."""

import atexit
import os
import shutil
import tempfile

if "TORCH_TPU_COMPILE_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="torchrec-tpu-test-cache-")
    os.environ["TORCH_TPU_COMPILE_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
