"""Suite-wide: every process the tests start compiles into a private persistent compile cache,
never the user's (``TORCH_TPU_COMPILE_CACHE`` is read when JAX is first used; child processes
inherit it)."""

import os
import tempfile

os.environ.setdefault("TORCH_TPU_COMPILE_CACHE", tempfile.mkdtemp(prefix="torchrec-tpu-test-cache-"))
