"""Slice naming, shapes, interconnect arithmetic and topology files, checked by hand."""

import json
from pathlib import Path

import pytest

from torchrec_tpu.topology import load_topology_file, parse_accelerator_type, resolve_topology
from tpu_facts import GIB


@pytest.mark.parametrize(
    "name, chips, shape, devices, sparsecores",
    [
        ("v5p-8", 4, (2, 2, 1), 4, 16),  # v5p counts TensorCores: 2 per chip
        ("v5p-64", 32, (2, 4, 4), 32, 128),
        ("v5p-128", 64, (4, 4, 4), 64, 256),
        ("v6e-64", 64, (8, 8), 64, 128),  # v6e counts chips
        ("v6e-256", 256, (16, 16), 256, 512),
        ("tpu7x-8", 4, (2, 2, 1), 8, 16),  # tpu7x: 2 TensorCores = 2 JAX devices per chip
        ("tpu7x-64", 32, (2, 4, 4), 64, 128),
        ("v5p-4x4x8", 128, (4, 4, 8), 128, 512),
    ],
)
def test_naming_conventions(name, chips, shape, devices, sparsecores):
    topo = parse_accelerator_type(name)
    assert (topo.num_chips, topo.shape, topo.num_devices, topo.num_sparsecores) == (chips, shape, devices, sparsecores)


def test_name_roundtrip_and_per_device_memory():
    assert parse_accelerator_type("v5p-4x4x4").name == "v5p-128"
    tpu7x = parse_accelerator_type("tpu7x-64")
    assert tpu7x.hbm_bytes_per_device == 96 * GIB  # 192 GiB per chip over two chiplets
    assert tpu7x.sparsecores_per_device == 2


@pytest.mark.parametrize(
    "name, message",
    [
        ("v5p-63", "multiple of 2"),
        ("v9-8", "unknown TPU generation"),
        ("v6e-48", "no standard v6e slice"),
        ("v5p-16x16x32", "exceeds the largest v5p slice"),
        ("v6e-4x4x4", "must be NxN"),
        ("v5p", "cannot parse"),
        ("v5p-2x3x1", "power-of-two"),
    ],
)
def test_bad_names(name, message):
    with pytest.raises(ValueError, match=message):
        parse_accelerator_type(name)


def test_mean_hops_torus_and_mesh():
    # 4x4x4 is a whole cube: rings of 4 -> mean distance floor(16/4)/4 = 1 per dim
    assert parse_accelerator_type("v5p-128").mean_ici_hops == pytest.approx(3.0)
    # 2x4x4 is a mesh: lines of 2 -> (4-1)/6 = 0.5, lines of 4 -> (16-1)/12 = 1.25
    assert parse_accelerator_type("v5p-64").mean_ici_hops == pytest.approx(0.5 + 1.25 + 1.25)


def test_all_to_all_arithmetic():
    topo = parse_accelerator_type("v5p-128")
    # 1 MB per device, 3 hops on average, 600 GB/s one-direction ICI per chip
    assert topo.all_to_all_seconds(1e6) == pytest.approx(1e6 * 3.0 / 600e9)
    two = parse_accelerator_type("v5p-128", num_slices=2)
    # half the bytes cross DCN at 50 Gb/s = 6.25 GB/s per chip
    assert two.all_to_all_seconds(1e6) == pytest.approx(1e6 * 3.0 / 600e9 + 0.5e6 / 6.25e9)
    assert two.num_devices == 128
    # tpu7x: two devices share one chip's links
    t7 = parse_accelerator_type("tpu7x-128")
    assert t7.hotspot_seconds_per_byte == pytest.approx(2 / 600e9)


def test_dense_allreduce_is_hierarchical_ici_then_dcn():
    """v6e-16 x 4 slices (C = 16 chips per slice, S = 4), 400 MB of gradient, by hand: 2 * 15/16 of
    it over 400 GB/s ICI (reduce-scatter + all-gather in the slice), then each chip's 1/16 shard
    all-reduced across the slices: 2 * 3/4 * 400e6/16 bytes over 12.5 GB/s DCN; 3 phases."""
    one, four = parse_accelerator_type("v6e-16"), parse_accelerator_type("v6e-16", num_slices=4)
    ici = 2 * 15 / 16 * 400e6 / 400e9
    dcn = 2 * 3 / 4 * (400e6 / 16) / 12.5e9
    latency = four.costs.collective_latency_s
    assert four.allreduce_phases == 3 and one.allreduce_phases == 1
    assert one.allreduce_seconds(400e6) == pytest.approx(ici + latency)
    assert four.allreduce_seconds(400e6) == pytest.approx(ici + dcn + 3 * latency)
    # one chip per slice: only the DCN all-reduce; one chip: nothing
    single = parse_accelerator_type("v6e-1", num_slices=2)
    assert single.allreduce_phases == 1
    assert single.allreduce_seconds(1e6) == pytest.approx(2 * 1 / 2 * 1e6 / 12.5e9 + latency)
    assert parse_accelerator_type("v6e-1").allreduce_seconds(1e6) == 0.0
    assert four.allreduce_seconds(0) == 0.0


def test_topology_file_overrides(tmp_path):
    path = tmp_path / "topo.yaml"
    path.write_text("slice: v6e-16\nnum_slices: 2\nchip:\n  hbm_gib: 16\ncosts:\n  hbm_reserved_fraction: 0.25\n")
    topo = load_topology_file(path)
    assert topo.num_chips == 32 and topo.shape == (4, 4)
    assert topo.hbm_bytes_per_device == 16 * GIB
    assert topo.usable_hbm_bytes_per_device == int(16 * GIB * 0.75)
    js = tmp_path / "topo.json"
    js.write_text(json.dumps({"generation": "v5p", "shape": "4x4x4", "costs": {"skew": 2.0}}))
    assert resolve_topology(str(js)).costs.skew == 2.0
    assert resolve_topology(str(js)).num_chips == 64


def test_topology_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("slice: v5p-8\nchip:\n  hbm_tib: 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_topology_file(bad)
    with pytest.raises(FileNotFoundError):
        resolve_topology(str(tmp_path / "missing.yaml"))


def test_v5e_and_v4_are_known_and_refused_with_a_clear_line(capsys):
    from torchrec_tpu.cli import main

    v4, v5e = parse_accelerator_type("v4-8"), parse_accelerator_type("v5e-16")
    assert (v4.num_chips, v4.shape, v4.num_sparsecores) == (4, (2, 2, 1), 0)  # v4 names count TensorCores
    assert (v5e.num_chips, v5e.shape, v5e.num_sparsecores) == (16, (4, 4), 0)
    tables = Path(__file__).resolve().parents[2] / "examples" / "planner" / "dlrm_dcnv2_tables.yaml"
    assert main(["plan", "--tables", str(tables), "--compare", "v5p-8,v5e-16,v4-8", "--batch-size", "4096"]) == 2
    out = capsys.readouterr().out
    assert "v5e-16: v5e has no SparseCore that jax-tpu-embedding drives" in out
    assert "v4-8: v4 has no SparseCore" in out and "plan on v5p, v6e or tpu7x" in out
    assert "v5p-8               4       4" in out  # the others still plan
