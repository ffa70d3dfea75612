"""The HSTU jagged attention op on the tpu device equals the plain-PyTorch reference written from the
paper's equations (tests/hstu/reference.py): forward and gradients, fp32 to 1e-5 and bf16 within
stated tolerances, XLA and Pallas (interpret mode) paths, eager and torch.compile(backend="tpu"),
over jagged batches with empty and length-1 sequences and with candidates; and the op's programs
(forward and backward, as lowered and as compiled) hold no [L, L] tensor at L = 1,024 and 4,096."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import torch_tpu  # noqa: F401  (the tpu device)
from tests.hstu import reference
from torch_tpu.ops.hstu import jagged_hstu_attention, tile_size
from torch_tpu.ops.hstu.jagged import _attention
from torch_tpu.ops.hstu.padded import xla_backward_block
from torch_tpu.runtime._jax import jax, jnp
from torchrec_tpu.hstu.attention import padded_attention

HEADS, QK, DV = 2, 8, 6
MAX_SEQ_LEN = 64
ALPHA = QK ** -0.5


def _batch(lengths, *, targets=None, seed=0, pos=MAX_SEQ_LEN, buckets=16):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total = int(lengths.sum())
    q, k = (torch.randn(total, HEADS, QK, generator=gen) for _ in range(2))
    v = torch.randn(total, HEADS, DV, generator=gen)
    gaps = torch.randint(0, 5000, (total,), generator=gen)
    timestamps = 1_700_000_000 + gaps.cumsum(0)  # epoch seconds, rising within each sequence
    num_targets = torch.tensor(targets if targets is not None else [0] * len(lengths))
    pos_w = torch.randn(pos, generator=gen) * 0.5
    ts_w = torch.randn(buckets + 1, generator=gen) * 0.5
    return dict(q=q, k=k, v=v, offsets=offsets, timestamps=timestamps, num_targets=num_targets,
                pos_w=pos_w, ts_w=ts_w)


def _reference(b, dtype=torch.float64):
    leaves = {n: b[n].to(dtype).requires_grad_() for n in ("q", "k", "v", "pos_w", "ts_w")}
    out = reference.attention(leaves["q"], leaves["k"], leaves["v"], b["offsets"], b["timestamps"],
                              leaves["pos_w"], leaves["ts_w"], max_seq_len=MAX_SEQ_LEN, alpha=ALPHA,
                              num_targets=b["num_targets"])
    return out, leaves


def _on_tpu(b, dtype, *, kernel, max_len, compiled=False):
    leaves = {n: b[n].to(dtype).to("tpu").requires_grad_() for n in ("q", "k", "v", "pos_w", "ts_w")}

    def run(q, k, v, pos_w, ts_w, offsets, timestamps, num_targets):
        return jagged_hstu_attention(q, k, v, offsets, timestamps, pos_w, ts_w, max_len=max_len,
                                     max_seq_len=MAX_SEQ_LEN, alpha=ALPHA, num_targets=num_targets, kernel=kernel)

    fn = torch.compile(run, backend="tpu") if compiled else run
    out = fn(leaves["q"], leaves["k"], leaves["v"], leaves["pos_w"], leaves["ts_w"], b["offsets"].to("tpu"),
             b["timestamps"].to("tpu"), b["num_targets"].to("tpu"))
    return out, leaves


def _compare(b, dtype, tol, *, kernel="xla", max_len=None, compiled=False):
    lengths = (b["offsets"][1:] - b["offsets"][:-1])
    max_len = max_len or max(int(lengths.max()), 1)
    expected, ref_leaves = _reference(b)
    got, leaves = _on_tpu(b, dtype, kernel=kernel, max_len=max_len, compiled=compiled)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.cpu().double(), expected.detach(), **tol)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    expected.backward(grad)
    got.backward(grad.to(dtype).to("tpu"))
    for name, leaf in ref_leaves.items():
        torch.testing.assert_close(leaves[name].grad.cpu().double(), leaf.grad, **tol, msg=lambda m: f"d{name}: {m}")


FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=3e-2, rtol=3e-2)  # bf16 inputs (8 mantissa bits), float32 scores and accumulation


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_fp32_matches_reference_with_empty_and_single_event_sequences(kernel):
    _compare(_batch([0, 1, 5, 17, 0, 30, 2]), torch.float32, FP32, kernel=kernel)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_candidates_attend_to_history_and_themselves(kernel):
    _compare(_batch([6, 1, 12, 4], targets=[2, 1, 3, 0]), torch.float32, FP32, kernel=kernel)


@pytest.mark.parametrize("kernel", ["xla", "pallas", "padded"])
def test_query_times_apart_from_key_times(kernel):
    """``timestamps [T, 2]``: row i's time bias is at its query time minus column j's own time (the
    paper layer queries at the next event's time)."""
    b = _batch([6, 1, 12, 4], targets=[2, 1, 3, 0], seed=4)
    own = b["timestamps"]
    later = torch.randint(0, 90000, own.shape, generator=torch.Generator().manual_seed(9))
    b["timestamps"] = torch.stack([own + later, own], 1)
    if kernel != "padded":
        _compare(b, torch.float32, FP32, kernel=kernel)
        return
    expected, _ = _reference(b)
    got = padded_attention(b["q"], b["k"], b["v"], b["offsets"], b["timestamps"], b["num_targets"], b["pos_w"],
                           b["ts_w"], max_len=12, max_seq_len=MAX_SEQ_LEN, alpha=ALPHA)
    torch.testing.assert_close(got.double(), expected.detach(), **FP32)
    at_own_time, _ = _reference({**b, "timestamps": own})
    assert (at_own_time - expected).abs().max() > 1e-3  # the query times change the result: 100x the tolerance


def test_several_tiles_and_a_bucket_above_the_longest_sequence():
    # 150 events -> two 128-tiles of a 256 bucket; pos table shorter than the distances (clamped)
    _compare(_batch([150, 3, 0, 129], targets=[5, 0, 0, 1], pos=40), torch.float32, FP32, max_len=200)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_bf16_within_tolerance(kernel):
    _compare(_batch([0, 1, 9, 23], seed=3), torch.bfloat16, BF16, kernel=kernel)


def test_compiled_equals_reference():
    _compare(_batch([3, 0, 11, 1], targets=[1, 0, 2, 0], seed=5), torch.float32, FP32, compiled=True)


def test_bucket_does_not_change_the_result():
    b = _batch([4, 9, 1], seed=2)
    small, _ = _on_tpu(b, torch.float32, kernel="xla", max_len=9)
    large, _ = _on_tpu(b, torch.float32, kernel="xla", max_len=40)
    torch.testing.assert_close(small.cpu(), large.cpu(), atol=1e-6, rtol=1e-6)


def test_a_sequence_above_max_len_is_refused():
    b = _batch([4, 9])
    with pytest.raises(ValueError, match="9 events, above max_len=8"):
        _on_tpu(b, torch.float32, kernel="xla", max_len=8)


def test_a_sequence_above_max_len_is_refused_under_torch_compile():
    # the compiled op read no values: the 9th event was cut off, silently
    b = _batch([4, 9])
    with pytest.raises(ValueError, match="9 events, above max_len=8"):
        _on_tpu(b, torch.float32, kernel="xla", max_len=8, compiled=True)


def test_a_traced_sequence_above_max_len_gives_nan_not_a_cut_result():
    """A trace without values (train_step's) cannot refuse: the output is NaN, not the attention of
    the sequence's first max_len events."""
    b = _batch([4, 9])
    arrays = [jnp.asarray(b[n].numpy()) for n in ("q", "k", "v", "offsets", "timestamps", "num_targets", "pos_w",
                                                   "ts_w")]
    out = np.asarray(jax.jit(lambda *a: _attention(*a, 8, MAX_SEQ_LEN, ALPHA, "xla"))(*arrays))
    assert np.isnan(out).all()
    fits = np.asarray(jax.jit(lambda *a: _attention(*a, 9, MAX_SEQ_LEN, ALPHA, "xla"))(*arrays))
    assert np.isfinite(fits).all()


def test_offsets_that_fall_or_leave_the_rows_are_refused():
    b = _batch([4, 3])
    with pytest.raises(ValueError, match=r"offsets must not decrease; offsets\[2\]=2 is below offsets\[1\]=4"):
        _on_tpu(dict(b, offsets=torch.tensor([0, 4, 2])), torch.float32, kernel="xla", max_len=8)
    with pytest.raises(ValueError, match=r"offsets run from 0 to 9; they must lie in \[0, 7\]"):
        _on_tpu(dict(b, offsets=torch.tensor([0, 4, 9])), torch.float32, kernel="xla", max_len=8)


def test_bad_kernel_and_shapes_are_refused():
    b = _batch([2, 3])
    with pytest.raises(ValueError, match="kernel='cuda'"):
        _on_tpu(b, torch.float32, kernel="cuda", max_len=3)
    q = b["q"].to("tpu")
    with pytest.raises(ValueError, match="timestamps must be"):
        jagged_hstu_attention(q, q, b["v"].to("tpu"), b["offsets"].to("tpu"), b["timestamps"][:2].to("tpu"),
                              b["pos_w"].to("tpu"), b["ts_w"].to("tpu"), max_len=3, max_seq_len=8, alpha=1.0)


def _attention_programs(kernel: str, seq: int, batch: int = 2) -> tuple[str, str]:
    """(StableHLO as lowered, HLO as compiled) of the op's forward and of its backward (with the
    forward it needs) at padded length ``seq``."""
    total = batch * seq
    args = (jax.ShapeDtypeStruct((total, HEADS, QK), jnp.float32),) * 2 + (
        jax.ShapeDtypeStruct((total, HEADS, DV), jnp.float32), jax.ShapeDtypeStruct((batch + 1,), jnp.int32),
        jax.ShapeDtypeStruct((total,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((seq,), jnp.float32), jax.ShapeDtypeStruct((17,), jnp.float32))

    def loss(q, k, v, offsets, ts, targets, pos_w, ts_w):
        out = _attention(q, k, v, offsets, ts, targets, pos_w, ts_w, seq, seq, 0.3, kernel)
        return out.sum()

    programs = [jax.jit(fn).lower(*args) for fn in (loss, jax.grad(loss, argnums=(0, 1, 2, 6, 7)))]
    return "\n".join(p.as_text() for p in programs), "\n".join(p.compile().as_text() for p in programs)


def _shapes(stablehlo: str, hlo: str) -> set[tuple[int, ...]]:
    """Every array shape either program text names (``tensor<2x128x8xf32>``, ``f32[2,128,8]``)."""
    found = re.findall(r"tensor<((?:\d+x)+)[a-z]", stablehlo)
    shapes = {tuple(int(d) for d in s.rstrip("x").split("x")) for s in found}
    shapes |= {tuple(int(d) for d in s.split(",")) for s in re.findall(r"\b(?:f|s|u|bf|pred)\d*\[([\d,]+)\]", hlo)}
    return shapes


@pytest.mark.parametrize(("kernel", "seq"), [("xla", 1024), ("xla", 4096), ("pallas", 1024)])
def test_no_length_squared_tensor_in_forward_or_backward(kernel, seq):
    batch = 2
    shapes = _shapes(*_attention_programs(kernel, seq, batch))
    block = tile_size(seq)
    for tile in {block, xla_backward_block(block) if kernel == "xla" else block}:  # the tiles are there instead
        assert (batch, HEADS, tile, tile) in shapes or (tile, tile) in shapes, f"no {tile}-tiles"
    squared = [s for s in shapes if sum(d >= seq for d in s) >= 2]
    assert not squared, f"[L, L]-sized buffers at L={seq}: {squared}"
    largest = max(math.prod(s) for s in shapes)
    assert largest * 8 <= batch * seq * seq, f"largest buffer {largest} elements at L={seq}"


def test_rows_past_the_last_offset_are_padding_and_come_out_zero():
    b = _batch([3, 0, 5], seed=4)
    padded = dict(b)
    for name in ("q", "k", "v"):
        padded[name] = torch.cat([b[name], torch.randn(4, *b[name].shape[1:])])
    padded["timestamps"] = torch.cat([b["timestamps"], b["timestamps"][-1:].repeat(4)])
    out, leaves = _on_tpu(padded, torch.float32, kernel="xla", max_len=5)
    expected, _ = _reference(b)
    torch.testing.assert_close(out[:8].cpu().double(), expected.detach(), **FP32)
    assert not out[8:].cpu().any()
    out.sum().backward()
    assert not leaves["q"].grad[8:].cpu().any()


@pytest.mark.parametrize("kernel", ["xla", "pallas", "padded"])
def test_rows_outside_the_sequences_come_out_zero_with_zero_gradients(kernel):
    """Offsets that start past row 0 and end before the last row: those rows belong to no sequence
    (zero output, zero q, k, v gradients); the rows inside equal the reference of the sequences alone."""
    inner = _batch([3, 4], targets=[1, 0], seed=4)
    lead, tail = 2, 3
    gen = torch.Generator().manual_seed(9)
    b = dict(inner, offsets=inner["offsets"] + lead)
    for name in ("q", "k", "v", "timestamps"):
        x = inner[name]
        around = [torch.randint(0, 10**9, (n,), generator=gen) if name == "timestamps"
                  else torch.randn(n, *x.shape[1:], generator=gen) for n in (lead, tail)]
        b[name] = torch.cat([around[0], x, around[1]])
    expected, ref_leaves = _reference(inner)
    if kernel == "padded":
        leaves = {n: b[n].clone().requires_grad_() for n in ("q", "k", "v", "pos_w", "ts_w")}
        got = padded_attention(leaves["q"], leaves["k"], leaves["v"], b["offsets"], b["timestamps"], b["num_targets"],
                               leaves["pos_w"], leaves["ts_w"], max_len=4, max_seq_len=MAX_SEQ_LEN, alpha=ALPHA)
    else:
        got, leaves = _on_tpu(b, torch.float32, kernel=kernel, max_len=4)
    inside = slice(lead, lead + expected.shape[0])
    got_cpu = got.cpu().double()
    torch.testing.assert_close(got_cpu[inside], expected.detach(), **FP32)
    assert not got_cpu[:lead].any() and not got_cpu[inside.stop:].any()
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    expected.backward(grad[inside])
    got.backward(grad.to(got.device, torch.float32))
    for name in ("q", "k", "v"):
        g = leaves[name].grad.cpu().double()
        torch.testing.assert_close(g[inside], ref_leaves[name].grad, **FP32, msg=lambda m: f"d{name}: {m}")
        assert not g[:lead].any() and not g[inside.stop:].any(), f"d{name} outside the sequences"
