"""torch.tpu.distributed.topology_aware_mesh: ranks placed by the device coordinates they report.

The reference is the MeshLayout of torch_tpu.distributed.topology_aware_mesh (itself checked
against hand-computed layouts in test_mesh.py), which assumes rank == device enumeration index, and
hand-written meshes for small slices; the 2-rank job feeds the tensor to torch's DeviceMesh."""

from __future__ import annotations

import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_tpu  # noqa: F401  (torch.tpu)
from torch_tpu.distributed import device_mesh, launch_local, topology_aware_mesh
from torch_tpu.distributed.mesh import DeviceCoords, device_index, enumerated_device, ranks_by_coordinates
from torch_tpu.runtime import device as tpu_device
from tpu_facts import Slice, chip_generation

V5P, V6E, TPU7X = (chip_generation(n) for n in ("v5p", "v6e", "tpu7x"))


@pytest.mark.parametrize("topo", [Slice(V5P, (2, 2, 4)), Slice(TPU7X, (2, 2, 1)), Slice(V6E, (4, 4), num_slices=2)],
                         ids=lambda t: t.name)
def test_enumeration_round_trips(topo: Slice) -> None:
    for index in range(topo.num_devices):
        assert device_index(enumerated_device(index, topo), topo) == index


def test_ranks_in_enumeration_order_give_the_layout() -> None:
    topo = Slice(V5P, (2, 2, 4))
    devices = [enumerated_device(r, topo) for r in range(topo.num_devices)]
    ranks = ranks_by_coordinates((4, 4), devices, topo)
    np.testing.assert_array_equal(ranks, topology_aware_mesh({"dp": 4, "tp": 4}, topology=topo).ranks)


@pytest.mark.parametrize("seed", range(3))
def test_shuffled_ranks_land_on_the_same_devices(seed: int) -> None:
    topo = Slice(V5P, (2, 2, 4))
    layout = topology_aware_mesh({"dp": 4, "tp": 4}, topology=topo)  # device indices by mesh position
    perm = np.random.default_rng(seed).permutation(topo.num_devices)  # rank r drives device perm[r]
    devices = [enumerated_device(int(perm[r]), topo) for r in range(topo.num_devices)]
    ranks = ranks_by_coordinates((4, 4), devices, topo)
    np.testing.assert_array_equal(perm[ranks], layout.ranks)  # each position's rank drives its device
    assert sorted(ranks.reshape(-1).tolist()) == list(range(16))


def test_hand_written_v6e_2x2() -> None:
    # devices enumerate x fastest: (0,0)=0 (1,0)=1 (0,1)=2 (1,1)=3; mesh (dp=2, tp=2): tp along x.
    topo = Slice(V6E, (2, 2))
    reported = [(1, 1), (0, 0), (0, 1), (1, 0)]  # rank 0 sits at (1,1), rank 1 at (0,0), ...
    ranks = ranks_by_coordinates((2, 2), [DeviceCoords(c + (0,)) for c in reported], topo)
    np.testing.assert_array_equal(ranks, [[1, 3], [2, 0]])


def test_multi_slice_shape_and_slices_outermost() -> None:
    topo = Slice(V6E, (2, 2), num_slices=2)
    perm = np.random.default_rng(7).permutation(8)
    devices = [enumerated_device(int(perm[r]), topo) for r in range(8)]
    ranks = ranks_by_coordinates((1, 4), devices, topo, kind="multi_slice", dcn_mesh_shape=(2, 1))
    assert ranks.shape == (2, 4)
    slices = np.vectorize(lambda r: devices[r].slice_index)(ranks)
    np.testing.assert_array_equal(slices, [[0] * 4, [1] * 4])  # the dcn dim is the slice
    expected = topology_aware_mesh({"a": 1, "b": 4}, dcn_mesh_dims={"a": 2}, topology=topo).ranks
    np.testing.assert_array_equal(perm[ranks], expected)


def test_clear_errors() -> None:
    topo = Slice(V6E, (2, 2))
    devices = [enumerated_device(r, topo) for r in range(4)]
    with pytest.raises(ValueError, match="same device"):
        ranks_by_coordinates((4,), devices[:3] + devices[:1], topo)
    with pytest.raises(ValueError, match="3 ranks"):
        ranks_by_coordinates((4,), devices[:3], topo)
    with pytest.raises(ValueError, match="outside"):
        ranks_by_coordinates((4,), devices[:3] + [DeviceCoords((2, 0, 0))], topo)
    with pytest.raises(ValueError, match="multi_slice"):
        ranks_by_coordinates((4,), devices, topo, dcn_mesh_shape=(1,))
    with pytest.raises(ValueError, match="unknown topology"):
        ranks_by_coordinates((4,), devices, topo, kind="torus")


def test_reported_attributes_honour_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tpu_device.COORDS_ENV, "1,0,2")
    monkeypatch.setenv(tpu_device.SLICE_ENV, "1")
    attrs = torch.tpu.get_local_device_attributes()
    assert attrs["coords"] == (1, 0, 2) and attrs["slice_index"] == 1
    assert {"id", "process_index", "device_kind", "platform"} <= set(attrs)
    monkeypatch.setenv(tpu_device.CORE_ENV, "x")
    with pytest.raises(ValueError, match=tpu_device.CORE_ENV):
        torch.tpu.get_local_device_attributes()


def _two_ranks(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    # the launcher numbered the ranks against the devices: rank 0 drives chip x=1, rank 1 chip x=0
    os.environ[tpu_device.COORDS_ENV] = f"{1 - rank},0,0"
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    ranks = device_mesh.topology_aware_mesh("cpu", (2,), slice_topology=Slice(V6E, (2, 1)))
    mesh = DeviceMesh("cpu", mesh=ranks, mesh_dim_names=("dp",))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=mesh.get_group("dp"))
    out = {"ranks": ranks, "coordinate": mesh.get_coordinate(), "sum": total}
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_two_ranks_with_swapped_coordinates_feed_device_mesh() -> None:
    got = launch_local(_two_ranks, 2, timeout_s=120)
    for rank, result in enumerate(got):
        torch.testing.assert_close(result["ranks"], torch.tensor([1, 0]))  # mesh position p: chip x=p
        assert list(result["coordinate"]) == [1 - rank]  # this rank sits where its chip is
        torch.testing.assert_close(result["sum"], torch.tensor([3.0]))


_TORCHRUN_MESH = """
import warnings
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    meshes = [torch.tpu.topology_aware_mesh(shape).tolist() for shape in ((2,), (1, 2))]
said = sum("ranks in order" in str(w.message) for w in caught)
print(f"rank {dist.get_rank()}: {meshes} said {said}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_topology_aware_mesh_under_plain_torchrun(tmp_path) -> None:
    """TorchTPU's ``topology_aware_mesh((2,))`` under plain torchrun off a TPU (no TPU_TOPOLOGY /
    TPU_ACCELERATOR_TYPE, only ``import torch``): the two ranks in order, said once per process."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    script = tmp_path / "mesh.py"
    script.write_text(_TORCHRUN_MESH)
    unset = ("TPU_TOPOLOGY", "TPU_ACCELERATOR_TYPE", "TORCH_TPU_AUTOLOAD", "TORCH_DEVICE_BACKEND_AUTOLOAD")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], cwd=repo, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r}: [[0, 1], [[0, 1]]] said 1" for r in (0, 1)], done.stdout[-3000:]
