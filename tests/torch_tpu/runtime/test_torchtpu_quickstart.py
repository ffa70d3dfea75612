"""TorchTPU's documented start runs here unchanged: ``import torch`` alone makes the "tpu" device
available (the ``torch.backends`` entry point, as TorchTPU's), lightly, and ``torch.compile`` with
no backend sends tpu inputs to the "tpu" backend. Each case runs in a fresh process with none of
the autoload switches set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchrec_tpu import _torch_tpu_autoload

REPO = Path(__file__).resolve().parents[3]
SWITCHES = ("TORCH_TPU_AUTOLOAD", "TORCH_DEVICE_BACKEND_AUTOLOAD")

# TorchTPU's quick start as its user writes it: no torch_tpu import, no environment variable. Each
# result is compared with the same computation on CPU (the reference).
QUICK_START = """
import sys
import torch

device = torch.device("tpu")
assert "torch_tpu" not in sys.modules and "jax" not in sys.modules, "import torch loaded the backend"

torch.manual_seed(0)
a, b = torch.randn(64, 32), torch.randn(32, 16)
c = torch.matmul(a.to(device), b.to(device))
assert c.device.type == "tpu", c.device
torch.testing.assert_close(c.cpu(), a @ b, rtol=1e-5, atol=1e-5)
assert torch.tpu.is_available() and torch.tpu.device_count() >= 1

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
reference = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
reference.load_state_dict(model.state_dict())
model.to(device)
x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
for net, inputs, labels in ((model, x.to(device), y.to(device)), (reference, x, y)):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(inputs), labels)
        loss.backward()
        optimizer.step()
for trained, expected in zip(model.parameters(), reference.parameters()):
    assert trained.device.type == "tpu"
    torch.testing.assert_close(trained.detach().cpu(), expected.detach(), rtol=1e-4, atol=1e-5)

compiled = torch.compile(model)  # no backend: tpu inputs go to the "tpu" backend
torch.testing.assert_close(compiled(x.to(device)).cpu(), reference(x), rtol=1e-4, atol=1e-5)
print("quick start ok")
"""


def _fresh_env(**env: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    return {**clean, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=_fresh_env(**env),
                          capture_output=True, text=True, timeout=600)


def test_torchtpu_quick_start_runs_with_nothing_set() -> None:
    done = _python(QUICK_START)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2:] == ["quick start ok", ""]


@pytest.mark.parametrize("switch", SWITCHES)
def test_either_switch_turns_the_device_off(switch: str) -> None:
    done = _python("import sys, torch; print(torch._C._get_privateuse1_backend_name(), hasattr(torch, 'tpu'))",
                   **{switch: "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["privateuseone", "False"]


def test_import_torch_stays_light() -> None:
    """The hook names the device and nothing more: no jax, no torch_tpu, until the device is used."""
    done = _python("""
        import sys, torch
        print(torch.device("tpu"), hasattr(torch.Tensor, "is_tpu"),
              sorted(m for m in ("jax", "torch_tpu", "torchrec") if m in sys.modules))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == "tpu True []"


def test_accelerator_calls_work_before_the_device_is_used() -> None:
    """With "tpu" named at ``import torch``, torch's accelerator calls ask its hooks at once:
    ``dist.barrier`` of a CPU gloo group (torchmetrics' sync does one), pinned memory; then the
    first tpu op loads torch_tpu with the same hooks."""
    done = _python("""
        import os, sys, torch
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        dist.barrier()
        print("torch_tpu" in sys.modules, torch.arange(4.0).pin_memory().is_pinned())
        print((torch.ones(2, device="tpu") * 3).cpu().tolist())
        dist.barrier()
        dist.destroy_process_group()
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["False True", "[3.0, 3.0]"], done.stdout


@pytest.mark.slow
def test_importing_torch_tpu_replaces_the_stand_ins() -> None:
    """``import torch_tpu`` after ``import torch`` (TorchTPU's docstrings do both): the real module."""
    done = _python("""
        import torch
        stand_in = torch.tpu
        import torch_tpu
        print(type(stand_in).__module__, type(torch.tpu).__module__, torch.tpu.is_available(),
              (torch.ones(2, device="tpu") * 3).cpu().tolist())
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == ("torchrec_tpu._torch_tpu_autoload torch_tpu._internal.public_api True "
                                          "[3.0, 3.0]")


def test_the_default_backend_sends_cpu_graphs_to_inductor_with_the_callers_mode(monkeypatch) -> None:
    """The other half of the routing: a graph with no tpu input gets torch.compile's own default
    (Inductor, configured by ``mode`` / ``options`` as torch.compile does)."""
    torch._dynamo.reset()  # an earlier test's compiled Linear would be reused: no backend call to see
    made: list[tuple] = []

    class Recorder:
        def __init__(self, mode, options, dynamic) -> None:
            made.append((mode, options, dynamic))

        def __call__(self, graph_module, example_inputs):
            return graph_module.forward

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", Recorder)
    compiled = torch.compile(torch.nn.Linear(3, 2), backend=_torch_tpu_autoload.default_backend,
                             options={"max_autotune": False})
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiled(x), compiled._orig_mod(x))
    assert made == [(None, {"max_autotune": False}, None)]
