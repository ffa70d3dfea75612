import pytest
import torch

import torch_tpu.compile as tc


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Keep the suite's compiles out of the user's cache directory."""
    tc.configure_cache(tmp_path_factory.mktemp("compile-cache"))
    yield


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch._dynamo.reset()
    tc.reset_compile_stats()
    tc.reset_cache_stats()
    yield
    torch._dynamo.reset()
