"""torch.save / torch.load with the tpu device on either side, ``map_location`` honoured as for
CUDA: CPU checkpoints load straight onto tpu (views stay views), tpu checkpoints load onto CPU.
Values are compared with the CPU tensors that were saved."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torch_tpu  # noqa: F401

REPO = Path(__file__).resolve().parents[3]


def _round_trip(obj: object, **load_kwargs: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, **load_kwargs)


@pytest.mark.parametrize("location", ["tpu", "tpu:0", torch.device("tpu"), {"cpu": "tpu"}],
                         ids=["str", "indexed", "device", "dict"])
def test_cpu_checkpoint_loads_onto_tpu(location: object) -> None:
    torch.manual_seed(0)
    saved = {"w": torch.randn(4, 3), "t": torch.randn(3, 5).t(), "i64": torch.tensor([2**40, -3]),
             "bf16": torch.randn(6).to(torch.bfloat16), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3)}
    loaded = _round_trip(saved, map_location=location)
    for name, value in saved.items():
        assert loaded[name].device.type == "tpu", name
        assert loaded[name].dtype == value.dtype and loaded[name].stride() == value.stride(), name
        torch.testing.assert_close(loaded[name].cpu(), value, rtol=0, atol=0)


def test_views_of_one_storage_load_as_views() -> None:
    base = torch.arange(12.0)
    loaded = _round_trip({"head": base[:6].view(2, 3), "tail": base[3:]}, map_location="tpu")
    loaded["head"].add_(100)
    assert loaded["tail"].cpu().tolist()[:3] == [103.0, 104.0, 105.0]


@pytest.mark.parametrize("load", [{}, {"weights_only": True}, {"map_location": "cpu"}],
                         ids=["tpu", "weights_only", "to_cpu"])
def test_tpu_views_saved_together_load_as_views_as_on_cpu(load: dict) -> None:
    # each tpu tensor was saved as a copy of its own values: the loaded view no longer aliased its base
    results = []
    for device in ("cpu", "tpu"):
        base = torch.arange(12.0, device=device)
        loaded = _round_trip({"base": base, "head": base[2:8].view(2, 3), "t": base.view(3, 4).t()}, **load)
        loaded["head"].mul_(-1)
        loaded["t"][1, 0] = 100.0
        assert loaded["t"].stride() == (1, 4) and loaded["head"].storage_offset() == 2
        results.append(loaded["base"].cpu())
        assert loaded["base"].device.type == load.get("map_location", device)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_a_storage_is_written_once_however_many_views_save_it() -> None:
    base = torch.zeros(100_000, device="tpu")
    sizes = []
    for obj in (base, [base, base[10:], base.view(100, 1000).t(), base[::2]]):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        sizes.append(len(buffer.getvalue()))
    assert sizes[1] < sizes[0] + 10_000  # one 400 kB storage, not four


def test_module_state_and_parameters_load_onto_tpu() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    model(torch.randn(5, 4))  # non-trivial running stats
    fresh = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).to("tpu")
    fresh.load_state_dict(_round_trip(model.state_dict(), map_location="tpu"))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key].cpu(), value, rtol=0, atol=0)
    param = _round_trip(nn.Parameter(torch.randn(3)), map_location="tpu")
    assert isinstance(param, nn.Parameter) and param.requires_grad and param.device.type == "tpu"


def _tied_model(device: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    model[2].weight = model[0].weight
    model[2].bias.requires_grad_(False)
    return model.to(device)


def _described(tensors: dict[str, torch.Tensor]) -> list[tuple]:
    return [(name, isinstance(t, nn.Parameter), t.requires_grad, t.detach().cpu().tolist())
            for name, t in tensors.items()]


@pytest.mark.parametrize("load", [{}, {"weights_only": True}, {"map_location": "cpu"}],
                         ids=["tpu", "weights_only", "to_cpu"])
def test_parameters_load_as_parameters_as_on_cpu(load: dict) -> None:
    # a tpu Parameter came back a plain tensor (CPU keeps Parameter and requires_grad)
    described = {}
    for device in ("cpu", "tpu"):
        loaded = _round_trip(_tied_model(device).state_dict(keep_vars=True), **load)
        assert {t.device.type for t in loaded.values()} == {load.get("map_location", device)}
        described[device] = _described(loaded)
    assert described["tpu"] == described["cpu"]
    assert [d[1:3] for d in described["cpu"]] == [(True, True)] * 3 + [(True, False)]


def test_a_saved_module_keeps_its_parameters_as_on_cpu() -> None:
    described, grads = {}, {}
    for device in ("cpu", "tpu"):
        loaded = _round_trip(_tied_model(device), weights_only=False)
        assert loaded[2].weight is loaded[0].weight  # the tie is kept
        loaded(torch.linspace(-1, 1, 6).reshape(2, 3).to(device)).sum().backward()
        described[device] = _described(dict(loaded.named_parameters()))
        grads[device] = [p.grad.cpu() for p in loaded.parameters() if p.requires_grad]
    assert described["tpu"] == described["cpu"]
    assert [d[1:3] for d in described["cpu"]] == [(True, True), (True, True), (True, False)]
    torch.testing.assert_close(grads["tpu"], grads["cpu"])


def test_tpu_checkpoint_maps_to_cpu() -> None:
    value = torch.randn(3, 2)
    saved = {"x": value.to("tpu").requires_grad_(), "y": value.to("tpu")}
    assert _round_trip(saved)["x"].device.type == "tpu"
    for location in ("cpu", {"tpu:0": "cpu"}):
        loaded = _round_trip(saved, map_location=location)
        assert type(loaded["x"]) is torch.Tensor and loaded["x"].device.type == "cpu"
        assert loaded["x"].requires_grad and not loaded["y"].requires_grad
        torch.testing.assert_close(loaded["x"].detach(), value, rtol=0, atol=0)


def test_tpu_checkpoint_loads_on_cpu_without_the_device(tmp_path: Path) -> None:
    """A checkpoint of tpu tensors needs no torch_tpu to load onto CPU (torch's own rebuild)."""
    path = tmp_path / "ckpt.pt"
    torch.save({"x": torch.arange(4.0).to("tpu")}, path)
    code = (f"import torch, sys; x = torch.load({str(path)!r}, map_location='cpu')['x']; "
            "assert 'torch_tpu' not in sys.modules; print(x.device, x.tolist())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "cpu [0.0, 1.0, 2.0, 3.0]"
