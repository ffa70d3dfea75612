"""torch.tpu.ops.align_jagged_to_multiple / strip_jagged_padding against a hand-written reference:
the values buffer padded with rows of ``padding_value`` to a multiple, the offsets unchanged, and
stripping the padding gives back the original tensor (CPU and tpu, eager and compiled)."""

from __future__ import annotations

import pytest
import torch
from torch.nested._internal import nested_tensor as _njt_impl

import torch_tpu  # noqa: F401

ops = torch.tpu.ops
LENGTHS = (3, 5, 2)  # 10 tokens


def _njt(device: str, dim: int = 4) -> torch.Tensor:
    torch.manual_seed(0)
    seqs = [torch.randn(n, dim) for n in LENGTHS]
    return torch.nested.nested_tensor([s.to(device) for s in seqs], layout=torch.jagged)


def _reference_padded(values: torch.Tensor, multiple: int, fill: float) -> torch.Tensor:
    rows = -(-values.shape[0] // multiple) * multiple
    out = torch.full((rows, *values.shape[1:]), fill, dtype=values.dtype)
    out[: values.shape[0]] = values
    return out


@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("multiple", [1, 4, 8, 128])
def test_align_pads_values_and_keeps_offsets(device: str, multiple: int) -> None:
    nt = _njt(device)
    padded = ops.align_jagged_to_multiple(nt, multiple, padding_value=-7.0)
    assert padded.is_nested and padded.layout == torch.jagged and padded.device.type == device
    ref = _reference_padded(nt.values().cpu(), multiple, -7.0)
    torch.testing.assert_close(padded.values().cpu(), ref, rtol=0, atol=0)
    assert padded.offsets().cpu().tolist() == [0, 3, 8, 10]
    values, offsets = padded.values().cpu(), [0, 3, 8, 10]
    for i, want in enumerate(nt.unbind()):  # the sequences are untouched
        torch.testing.assert_close(values[offsets[i]:offsets[i + 1]], want.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("valid_tokens", [None, 10])
def test_strip_round_trips(device: str, valid_tokens: int | None) -> None:
    nt = _njt(device)
    stripped = ops.strip_jagged_padding(ops.align_jagged_to_multiple(nt, 8), valid_tokens)
    assert stripped.values().shape == (10, 4)
    torch.testing.assert_close(stripped.values().cpu(), nt.values().cpu(), rtol=0, atol=0)
    assert stripped.offsets().cpu().tolist() == [0, 3, 8, 10]


def test_aligned_tensor_comes_back_unchanged() -> None:
    nt = _njt("cpu")
    assert ops.align_jagged_to_multiple(nt, 5) is nt  # 10 tokens: already a multiple of 5
    assert ops.strip_jagged_padding(nt) is nt


def test_integer_values_and_bool_padding() -> None:
    nt = torch.nested.nested_tensor([torch.arange(3), torch.arange(2)], layout=torch.jagged)
    padded = ops.align_jagged_to_multiple(nt, 4, padding_value=True)
    assert padded.values().tolist() == [0, 1, 2, 0, 1, 1, 1, 1]
    assert padded.values().dtype == torch.int64


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_compiled_round_trip(device: str) -> None:
    """Inside torch.compile(backend="tpu"), on a jagged tensor built in the graph from its values
    and offsets (a nested tensor as a graph input is not supported by the backend yet)."""
    nt = _njt(device)

    @torch.compile(backend="tpu", fullgraph=True)
    def step(values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        padded = ops.align_jagged_to_multiple(_njt_impl.nested_view_from_values_offsets(values, offsets), 8)
        doubled = padded * 2.0
        return doubled.values(), ops.strip_jagged_padding(doubled, 10).values()

    padded, stripped = step(nt.values(), nt.offsets())
    want = _reference_padded(nt.values().cpu(), 8, 0.0) * 2.0
    torch.testing.assert_close(padded.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(stripped.cpu(), want[:10], rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_a_nested_graph_input_is_refused_with_the_way_that_works(device: str) -> None:
    # it failed deep in the backend: 'NestedIntNode' object has no attribute 'expr'
    nt = _njt(device)
    aligned = torch.compile(lambda x: ops.align_jagged_to_multiple(x, 8), backend="tpu")
    with pytest.raises(Exception, match=r"torch.compile\(backend='tpu'\): an input is a nested tensor "
                                        r"\(torch.jagged, shape \(3, j\d+, 4\)\).*pass its values\(\) and "
                                        r"offsets\(\) and build it inside") as info:
        aligned(nt)
    assert isinstance(getattr(info.value, "inner_exception", info.value), NotImplementedError)  # (Dynamo wraps it)

    @torch.compile(backend="tpu", fullgraph=True)
    def built_inside(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return ops.align_jagged_to_multiple(torch.nested.nested_tensor_from_jagged(values, offsets), 8).values()

    want = _reference_padded(nt.values().cpu(), 8, 0.0)
    torch.testing.assert_close(built_inside(nt.values(), nt.offsets()).cpu(), want, rtol=0, atol=0)


def test_bad_arguments_are_named() -> None:
    nt = _njt("cpu")
    with pytest.raises(ValueError, match="multiple must be a positive integer, got 0"):
        ops.align_jagged_to_multiple(nt, 0)
    with pytest.raises(ValueError, match=r"valid_tokens must be an integer in \[0, 10\].*got 11"):
        ops.strip_jagged_padding(nt, 11)
    with pytest.raises(TypeError, match="torch.jagged nested tensor"):
        ops.align_jagged_to_multiple(torch.zeros(3, 4))
