"""torch.profiler with ProfilerActivity.PrivateUse1 on tpu: host (Kineto) and device (jax.profiler)
events in one Chrome trace, and one TensorBoard run the profile plugin (XProf) opens. References:
torch's own cpu_op events (the device ops must follow the host calls that issued them) and XProf's
converter reading the run's XSpace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

import torch_tpu  # noqa: F401
from torch_tpu.runtime import profiler as tpu_profiler

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]


def _work(x: torch.Tensor, steps: int = 3) -> None:
    for _ in range(steps):
        (x @ x).relu().sum().item()


def _events(path: Path) -> tuple[list[dict], list[dict]]:
    events = json.loads(path.read_text())["traceEvents"]
    return ([e for e in events if e.get("cat") == "cpu_op"], [e for e in events if e.get("cat") == "kernel"])


def test_a_cpu_only_profile_records_no_device(tmp_path: Path) -> None:
    x = torch.randn(16, 16, device="tpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _work(x, 1)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    host, device = _events(tmp_path / "trace.json")
    assert host and not device
    assert tpu_profiler.device_xspace(prof) is None


def test_one_trace_holds_host_and_device_events(tmp_path: Path) -> None:
    x = torch.randn(64, 64, device="tpu")
    _work(x, 2)  # compile the per-op programs outside the window
    with profile(activities=ACTIVITIES) as prof:
        _work(x)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    host, device = _events(tmp_path / "trace.json")
    host_mm = sorted(e["ts"] for e in host if e["name"] == "aten::mm")
    device_mm = sorted(e["ts"] for e in device if e["args"].get("hlo_module", "").endswith("aten.mm.default"))
    assert len(host_mm) == 3 and len(device_mm) == 3
    # one clock: each matmul runs on the device after the host issued it, inside the window
    assert all(d >= h for h, d in zip(host_mm, device_mm))
    end = max(e["ts"] + e["dur"] for e in host)
    assert all(host_mm[0] <= e["ts"] <= end for e in device)
    assert {e["args"]["device"] for e in device} == {"tpu:0"}


def test_tensorboard_run_opens_in_the_profile_plugin(tmp_path: Path) -> None:
    xprof_convert = pytest.importorskip("xprof.convert.raw_to_tool_data")
    x = torch.randn(32, 32, device="tpu")
    _work(x, 1)
    with profile(activities=ACTIVITIES, schedule=schedule(wait=1, warmup=0, active=1, repeat=1),
                 on_trace_ready=tpu_profiler.tensorboard_trace_handler(tmp_path, "worker0")) as prof:
        for _ in range(2):
            _work(x, 1)
            prof.step()
    (run,) = (tmp_path / "plugins" / "profile").iterdir()
    assert sorted(p.name for p in run.iterdir()) == ["worker0.pt.trace.json", "worker0.xplane.pb"]
    host, device = _events(run / "worker0.pt.trace.json")
    assert any(e["name"] == "aten::mm" for e in host) and device
    # XProf (TensorBoard's profile plugin) converts the run's XSpace for its trace viewer
    data, content_type = xprof_convert.xspace_to_tool_data([str(run / "worker0.xplane.pb")], "trace_viewer", {})
    assert content_type == "application/json" and "aten.mm.default" in str(data)
