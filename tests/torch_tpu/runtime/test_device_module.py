"""The torch.tpu device module, registration and the torch.backends autoload entry point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_tpu  # noqa: F401


def test_device_module_api():
    tpu = torch.tpu
    assert tpu.is_available() and tpu.is_initialized()
    assert tpu.device_count() == 1 and tpu.current_device() == 0
    tpu.set_device(0)
    tpu.set_device("tpu:0")
    with pytest.raises(RuntimeError, match="one device per process"):
        tpu.set_device(1)
    x = torch.ones(1000, device="tpu") * 3
    tpu.synchronize()
    assert "CPU" in tpu.get_device_name() or "TPU" in tpu.get_device_name()
    props = tpu.get_device_properties(0)
    assert props.platform in ("cpu", "tpu")
    assert tpu.memory_allocated() >= x.numel() * 4
    assert tpu.max_memory_allocated() >= tpu.memory_allocated() - x.numel() * 4
    assert tpu.memory_stats()["allocated_bytes.all.current"] > 0
    s = tpu.current_stream()
    e = s.record_event()
    e.synchronize()
    assert e.query() and s.query() and isinstance(tpu.Stream(), tpu.Stream)
    state = tpu.get_rng_state()
    a = torch.randn(4, device="tpu").cpu()
    tpu.set_rng_state(state)
    torch.testing.assert_close(torch.randn(4, device="tpu").cpu(), a, rtol=0, atol=0)


def test_device_index_must_be_zero():
    with pytest.raises(RuntimeError, match="index 1"):
        torch.empty(2, device="tpu:1")


def test_autoload_entry_point_gives_a_working_device():
    code = "import torch; x = torch.ones(3, device='tpu') + 1; print(x.device, x.cpu().tolist())"
    env = dict(os.environ, TORCH_TPU_AUTOLOAD="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tpu:0 [2.0, 2.0, 2.0]"
    env["TORCH_TPU_AUTOLOAD"] = "0"
    off = subprocess.run([sys.executable, "-c", "import torch; print(torch._C._get_privateuse1_backend_name())"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert off.stdout.strip() == "privateuseone", off.stderr


def test_synchronize_after_a_program_took_the_last_ops_output():
    """The last eager op's array donated to a compiled program (a train step's tables and optimizer
    state): synchronize, events and queries wait for that program, not on the consumed array."""
    from torch_tpu.compile.program.executables import CompiledProgram
    from torch_tpu.runtime import device as tpu_device
    from torch_tpu.runtime.tensor import to_jax

    tpu = torch.tpu
    event = tpu.current_stream().record_event()
    state = torch.arange(1000, device="tpu") * 0.0  # the newest eager output
    assert tpu_device.last_output[0] is to_jax(state)
    double = CompiledProgram(lambda a: a * 2 + 1, donated=(0,))
    out = double(to_jax(state))
    assert to_jax(state).is_deleted()
    tpu.synchronize()
    event.synchronize()
    assert event.query() and tpu.current_stream().query() and out.is_ready()
    assert float(out[0]) == 1.0
