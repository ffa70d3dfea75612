"""The device's numeric knobs out of range: ``import torch_tpu`` stops with one line naming the
variable, the value and the range (it took -1 silently: an op cache of -1 programs, a slice -1),
and the readers that run later refuse them too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch_tpu  # noqa: F401
from torch_tpu.distributed import xla_join
from torch_tpu.runtime import device as tpu_device
from tpu_facts import knobs

REPO = Path(__file__).resolve().parents[3]


def test_a_negative_knob_stops_the_import_with_one_line():
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_TPU_OP_JIT_MAX": "-1", "TORCH_TPU_SLICE_INDEX": "0"}
    proc = subprocess.run([sys.executable, "-c", "import torch_tpu"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "torch_tpu: error: TORCH_TPU_OP_JIT_MAX='-1': expected an integer >= 1"], proc.stderr[-3000:]


@pytest.mark.parametrize(("knob", "value", "takes"), [
    (knobs.CORE_ON_CHIP, "-1", "an integer >= 0"), (knobs.SLICE_INDEX, "-1", "an integer >= 0"),
    (knobs.DEVICE_COORDS, "1,-1,0", "1 to 3 comma-separated integers >= 0"),
    (knobs.DEVICE_COORDS, "1,0,0,2", "1 to 3 comma-separated integers >= 0"),
], ids=["core", "slice", "coords", "coords_4d"])
def test_device_attributes_refuse_a_negative_override(monkeypatch, knob, value, takes):
    monkeypatch.setenv(knob.name, value)
    with pytest.raises(ValueError, match=f"^{knob.name}='{value}': expected {takes}$"):
        tpu_device.get_local_device_attributes()


def test_device_attributes_take_overrides_in_range(monkeypatch):
    monkeypatch.setenv(knobs.DEVICE_COORDS.name, "1,0,2")
    monkeypatch.setenv(knobs.CORE_ON_CHIP.name, "0")
    monkeypatch.setenv(knobs.SLICE_INDEX.name, "3")
    attrs = tpu_device.get_local_device_attributes()
    assert (attrs["coords"], attrs["core_on_chip"], attrs["slice_index"]) == ((1, 0, 2), 0, 3)


@pytest.mark.parametrize(("offset", "port", "message"), [
    ("-1", "29500", r"TPU_DIST_XLA_PORT_OFFSET='-1': expected an integer in \[1, 65534\]"),
    ("100", "65500", "MASTER_PORT plus TPU_DIST_XLA_PORT_OFFSET=100 is port 65600, above 65535"),
])
def test_the_coordinator_port_offset_is_checked(monkeypatch, offset, port, message):
    monkeypatch.setenv(knobs.DIST_PORT_OFFSET.name, offset)
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(ValueError, match=message):
        xla_join._rendezvous(None, 0, None)
