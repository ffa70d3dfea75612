"""topology_aware_mesh: hand-computed layouts, locality properties, env parsing, clear errors."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_tpu.distributed import topology_aware_mesh
from tpu_facts import Slice, chip_generation

V5P, V6E, TPU7X = (chip_generation(n) for n in ("v5p", "v6e", "tpu7x"))


def _coords(rank: int, topo: Slice) -> tuple[int, ...]:
    """Inverse of the documented enumeration: rank -> (slice, core, x, y, z) by hand arithmetic."""
    per_slice = topo.devices_per_slice
    slice_index, local = divmod(rank, per_slice)
    out = [slice_index]
    for _, size in topo.axes:  # fastest first
        local, c = divmod(local, size)
        out.append(c)
    return tuple(out)


def test_v5p_2x2x4_tp_on_z_dp_on_xy() -> None:
    topo = Slice(V5P, (2, 2, 4))
    layout = topology_aware_mesh({"dp": 4, "tp": 4}, topology=topo)
    # tp=4 fits the z axis alone (rank stride X*Y=4); dp=4 takes x (stride 1) then y (stride 2).
    expected = np.array([[d + 4 * t for t in range(4)] for d in range(4)])
    np.testing.assert_array_equal(layout.ranks, expected)
    assert layout.mesh_shape == (4, 4) and layout.mesh_dim_names == ("dp", "tp")
    assert layout.physical_axes == {"dp": ("x", "y"), "tp": ("z",)}
    assert not layout.is_identity


def test_tpu7x_puts_innermost_dim_on_the_two_chiplets() -> None:
    topo = Slice(TPU7X, (2, 2, 1))
    layout = topology_aware_mesh([("dp", 4), ("tp", 2)], topology=topo)
    np.testing.assert_array_equal(layout.ranks, np.arange(8).reshape(4, 2))
    assert layout.physical_axes == {"dp": ("x", "y"), "tp": ("core",)}
    assert layout.is_identity


def test_split_axis_keeps_inner_dim_contiguous() -> None:
    topo = Slice(V6E, (4, 4))
    layout = topology_aware_mesh({"dp": 8, "tp": 2}, topology=topo)
    # tp=2 takes the inner half of x (neighbours 2k, 2k+1); dp takes the rest of x, then y.
    np.testing.assert_array_equal(layout.ranks, np.arange(16).reshape(8, 2))
    assert layout.physical_axes == {"dp": ("x", "y"), "tp": ("x",)}


def test_multislice_dcn_outermost_within_its_dim() -> None:
    topo = Slice(V6E, (2, 2), num_slices=2)
    layout = topology_aware_mesh({"dp": 2, "tp": 2}, dcn_mesh_dims={"dp": 2}, topology=topo)
    # dp = (slice, y): rows 0,1 are slice 0, rows 2,3 slice 1 (ranks + 4); tp = x.
    np.testing.assert_array_equal(layout.ranks, [[0, 1], [2, 3], [4, 5], [6, 7]])
    assert layout.mesh_shape == (4, 2)
    assert layout.physical_axes == {"dp": ("dcn", "y"), "tp": ("x",)}


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPU_TOPOLOGY", "2x2x4")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-32")
    monkeypatch.setenv("TPU_NUM_SLICES", "2")
    topo = Slice.from_env()
    assert (topo.chip.name, topo.shape, topo.num_slices, topo.num_devices) == ("v5p", (2, 2, 4), 2, 32)
    layout = topology_aware_mesh({"dp": 4, "tp": 4})  # slices default to the first dim
    assert layout.mesh_shape == (8, 4) and layout.physical_axes["dp"][0] == "dcn"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "TPU_TOPOLOGY is not set"),
        ({"TPU_TOPOLOGY": "2x2x4"}, "cannot tell the TPU generation"),
        ({"TPU_TOPOLOGY": "2by2", "TPU_ACCELERATOR_TYPE": "v5p-8"}, "not a shape"),
        ({"TPU_TOPOLOGY": "4x4", "TPU_ACCELERATOR_TYPE": "v5p-32"}, "v5p slice topology must be NxNxN"),
        ({"TPU_TOPOLOGY": "4x4", "TPU_ACCELERATOR_TYPE": "v9z-16"}, "unknown TPU generation 'v9z'"),
    ],
)
def test_from_env_errors(monkeypatch: pytest.MonkeyPatch, env: dict, message: str) -> None:
    for var in ("TPU_TOPOLOGY", "TPU_ACCELERATOR_TYPE", "TPU_NUM_SLICES", "MEGASCALE_NUM_SLICES"):
        monkeypatch.delenv(var, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        Slice.from_env()


@pytest.mark.parametrize(
    ("dims", "kwargs", "message"),
    [
        ({"dp": 3, "tp": 5}, {}, "hold 15 devices per slice, but a 2x2x4 v5p slice has 16"),
        ({"dp": 16, "tp": 1}, {"dcn_mesh_dims": {"pp": 2}}, r"names \['pp'\], which are not mesh dims"),
        ({"dp": 16}, {"dcn_mesh_dims": {"dp": 3}}, "span 3 slices, but the topology has 1"),
        ({"dp": 16, "tp": 0}, {}, "mesh dim 'tp' must have a positive integer size"),
        ([("dp", 4), ("dp", 4)], {}, "mesh dim 'dp' is given twice"),
    ],
)
def test_mesh_errors(dims: object, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        topology_aware_mesh(dims, topology=Slice(V5P, (2, 2, 4)), **kwargs)


def test_unplaceable_dim_names_the_dim_and_free_axes() -> None:
    # 6 x 6 v6e: a dim of 4 needs a divisor 4 of one axis, or two whole axes multiplying to 4.
    with pytest.raises(ValueError, match=r"cannot place mesh dim 'tp' of size 4 on the free physical"):
        topology_aware_mesh({"dp": 9, "tp": 4}, topology=Slice(V6E, (6, 6)))


def _factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [c for c in itertools.product(divisors, repeat=parts) if math.prod(c) == n]


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Slice, dict[str, int]]:
    chip = draw(st.sampled_from([V5P, V6E, TPU7X]))
    shape = tuple(draw(st.sampled_from([1, 2, 4, 8])) for _ in range(chip.torus_dims))
    topo = Slice(chip, shape)
    sizes = draw(st.sampled_from(_factorisations(topo.devices_per_slice, draw(st.integers(1, 3)))))
    return topo, {f"d{i}": s for i, s in enumerate(sizes)}


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_every_group_stays_on_its_physical_axes(case: tuple[Slice, dict[str, int]]) -> None:
    """Ranks are a permutation; moving along a mesh dim changes only that dim's physical axes."""
    topo, dims = case
    layout = topology_aware_mesh(dims, topology=topo)
    assert sorted(layout.ranks.reshape(-1).tolist()) == list(range(topo.devices_per_slice))
    axis_index = {name: i + 1 for i, (name, _) in enumerate(topo.axes)}
    for d, name in enumerate(layout.mesh_dim_names):
        allowed = {axis_index[a] for a in layout.physical_axes[name]}
        moved = np.moveaxis(layout.ranks, d, -1).reshape(-1, layout.mesh_shape[d])
        for group in moved:
            coords = np.array([_coords(int(r), topo) for r in group])
            changed = {i for i in range(coords.shape[1]) if len(set(coords[:, i])) > 1}
            assert changed <= allowed, (name, group, layout.physical_axes)
