"""Meta's two STU layers (``paper``: the 2024 paper's code; ``dlrmv3``: the layer MLPerf's DLRMv4
runs) equal plain-PyTorch references written from each one's equations (tests/hstu/reference.py):
forward and gradients, fp32 to 1e-5 (the CPU layer attending by the padded PyTorch attention and by
the jagged op on the tpu device), bf16 within a stated tolerance; the paper layer's time bias at the
next event's time, its input LayerNorm and its N (the padded width), DLRMv3's N (the batch's longest
history + most candidates); dropout in training only; and the HSTU model of each preset."""

from __future__ import annotations

import pytest
import torch

import torch_tpu  # noqa: F401  (the tpu device)
from tests.hstu import reference
from tests.hstu.batches import batch_kjt
from torchrec_tpu.hstu import attention
from torchrec_tpu.hstu.attention import CPU_JAGGED_FROM, PADDED
from torchrec_tpu.hstu.config import PRESETS, HSTUConfig, preset
from torchrec_tpu.hstu.layers import DLRMv3STU, LegacySTU, PaperSTU, Sequences
from torchrec_tpu.hstu.model import HSTU, sequence_layout

DIM, HEADS, QK, DV, N = 12, 2, 4, 3, 32
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16_RELATIVE = 3e-2  # bf16: 8 mantissa bits, LayerNorms and sums in bf16: 3% of the tensor's norm
LENGTHS, TARGETS = [0, 1, 6, 13, 2], [0, 1, 2, 3, 0]


def _paper(seed=0, kernel="xla", dropout=0.0):
    torch.manual_seed(seed)
    layer = PaperSTU(DIM, HEADS, QK, DV, N, time_buckets=12, dropout=dropout, kernel=kernel)
    with torch.no_grad():  # larger biases than the 0.02 init, so that every term counts
        layer.pos_weights.normal_(0, 0.5)
        layer.time_weights.normal_(0, 0.5)
    return layer


def _dlrmv3(seed=0, kernel="xla", dropout=0.0):
    torch.manual_seed(seed)
    layer = DLRMv3STU(DIM, HEADS, QK, DV, dropout=dropout, kernel=kernel)
    with torch.no_grad():  # norms and bias away from their ones/zeros init
        for p in (layer.input_norm.weight, layer.output_norm.weight):
            p.normal_(1.0, 0.3)
        for p in (layer.input_norm.bias, layer.output_norm.bias, layer.uvqk_bias):
            p.normal_(0, 0.3)
    return layer


def _paper_params(layer, dtype=torch.float64):
    named = {"w1": layer.uvqk, "w2": layer.out.weight.T, "b2": layer.out.bias, "pos_w": layer.pos_weights,
             "ts_w": layer.time_weights}
    return {k: v.detach().to(dtype).requires_grad_() for k, v in named.items()}


def _dlrmv3_params(layer, dtype=torch.float64):
    named = {"ln1_w": layer.input_norm.weight, "ln1_b": layer.input_norm.bias, "w1": layer.uvqk_weight,
             "c1": layer.uvqk_bias, "ln2_w": layer.output_norm.weight, "ln2_b": layer.output_norm.bias,
             "w2": layer.output_weight}
    return {k: v.detach().to(dtype).requires_grad_() for k, v in named.items()}


_PAPER_GRADS = {"w1": lambda m: m.uvqk.grad, "w2": lambda m: m.out.weight.grad.T, "b2": lambda m: m.out.bias.grad,
                "pos_w": lambda m: m.pos_weights.grad, "ts_w": lambda m: m.time_weights.grad}
_DLRMV3_GRADS = {"ln1_w": lambda m: m.input_norm.weight.grad, "ln1_b": lambda m: m.input_norm.bias.grad,
                 "w1": lambda m: m.uvqk_weight.grad, "c1": lambda m: m.uvqk_bias.grad,
                 "ln2_w": lambda m: m.output_norm.weight.grad, "ln2_b": lambda m: m.output_norm.bias.grad,
                 "w2": lambda m: m.output_weight.grad}


def _jagged(lengths, targets, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    x = torch.randn(int(lengths.sum()), DIM, generator=gen) * 2 + 0.5  # not already normalized
    ts = 1_600_000_000 + torch.randint(0, 90000, (x.shape[0],), generator=gen).cumsum(0)
    return x, offsets, ts, torch.tensor(targets)


def _next_times(offsets, ts, targets):
    """The ``[T, 2]`` times of the paper layer's batch: each row's query time (by the model's layout)
    then its own."""
    lengths = offsets[1:] - offsets[:-1]
    layout = sequence_layout(lengths - targets, targets)
    return torch.stack([ts[layout.next_row], ts], dim=1)


def _close(got, expected, tol, what):
    if tol is None:
        error = (got.cpu().double() - expected).norm() / expected.norm().clamp(min=1e-12)
        assert error < BF16_RELATIVE, f"{what}: relative error {error:.3g} (bf16 tolerance {BF16_RELATIVE})"
    else:
        torch.testing.assert_close(got.cpu().double(), expected, **tol, msg=lambda m: f"{what}: {m}")


def _run(layer, params, grads_of, expected_fn, x, seq, dtype, tol):
    """The layer's output and gradients against the float64 reference ``expected_fn(x, params)``."""
    ref_x = x.double().requires_grad_()
    expected = expected_fn(ref_x, params)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected.backward(grad)
    ours = layer.to(dtype).eval()
    got_x = x.to(dtype).requires_grad_()
    got = ours(got_x, seq)
    assert got.dtype == dtype
    _close(got, expected.detach(), tol, "output")
    got.backward(grad.to(dtype))
    _close(got_x.grad, ref_x.grad, tol, "dx")
    for name, read in grads_of.items():
        _close(read(ours), params[name].grad, tol, f"d{name}")


CASES = [  # the CPU layer, the jagged op on tpu (~20 s of compiling; the model test below runs the op by default)
         pytest.param(torch.float32, FP32, "xla", CPU_JAGGED_FROM, marks=pytest.mark.slow),
         (torch.float32, FP32, "xla", 16),  # a short CPU batch: the padded PyTorch attention
         (torch.float32, FP32, PADDED, CPU_JAGGED_FROM),  # plain PyTorch
         (torch.bfloat16, None, PADDED, 16)]


@pytest.mark.parametrize("dtype,tol,kernel,max_len", CASES)
def test_paper_layer_matches_its_reference(dtype, tol, kernel, max_len):
    layer = _paper(kernel=kernel, dropout=0.2)  # dropout set: eval mode must not apply it
    x, offsets, ts, targets = _jagged(LENGTHS, TARGETS)
    params = _paper_params(layer)
    seq = Sequences(offsets, _next_times(offsets, ts, targets), targets, max_len=max_len)
    if kernel != PADDED and max_len >= CPU_JAGGED_FROM:
        seq = Sequences(*(t.to("tpu") for t in (seq.offsets, seq.timestamps, seq.num_targets)), max_len=max_len)
    _run(layer, params, _PAPER_GRADS,
         lambda rx, p: reference.paper_stu_layer(rx, offsets, ts, p, heads=HEADS, qk_dim=QK, v_dim=DV,
                                                 max_seq_len=N, num_targets=targets), x, seq, dtype, tol)


@pytest.mark.parametrize("dtype,tol,kernel,max_len", CASES)
def test_dlrmv3_layer_matches_its_reference(dtype, tol, kernel, max_len):
    layer = _dlrmv3(kernel=kernel, dropout=0.1)
    x, offsets, ts, targets = _jagged(LENGTHS, TARGETS)
    params = _dlrmv3_params(layer)
    width = int(max(n - t for n, t in zip(LENGTHS, TARGETS)) + max(TARGETS))  # 10 + 3: no one row has 13 + 3
    times = torch.stack([ts, ts], dim=1)
    on = "tpu" if kernel != PADDED and max_len >= CPU_JAGGED_FROM else "cpu"
    seq = Sequences(offsets.to(on), times.to(on), targets.to(on), max_len=max_len, longest=width)
    _run(layer, params, _DLRMV3_GRADS,
         lambda rx, p: reference.dlrmv3_stu_layer(rx, offsets, p, heads=HEADS, qk_dim=QK, v_dim=DV, n_norm=width,
                                                  num_targets=targets), x, seq, dtype, tol)


def _paper_out(layer, x, offsets, times, targets):
    return layer.eval()(x, Sequences(offsets, times, targets, max_len=16)).detach()


def test_paper_time_bias_is_at_the_next_events_time_and_n_is_the_padded_width():
    layer = _paper(kernel=PADDED)
    x, offsets, ts, targets = _jagged([7, 5], [2, 0])
    got = _paper_out(layer, x, offsets, _next_times(offsets, ts, targets), targets)
    params = {k: v.detach() for k, v in _paper_params(layer).items()}
    kwargs = dict(heads=HEADS, qk_dim=QK, v_dim=DV, max_seq_len=N, num_targets=targets)
    at_own_time = reference.paper_stu_layer(x.double(), offsets, ts, params, next_event_time=False, **kwargs)
    at_next_time = reference.paper_stu_layer(x.double(), offsets, ts, params, **kwargs)
    assert (at_own_time - at_next_time).abs().max() > 1e-3  # the index matters: 100x the tolerance
    torch.testing.assert_close(got.double(), at_next_time, **FP32)
    # the last history event (row 4) queries at the first candidate's time: rows 0-3 at their successors'
    assert _next_times(offsets, ts, targets)[:, 0].tolist() == ts[[1, 2, 3, 4, 5, 5, 6, 8, 9, 10, 11, 11]].tolist()
    # N is the padded width: a user's output does not depend on the batch's other sequences
    alone = _paper_out(layer, x[7:], offsets[1:] - 7, _next_times(offsets[1:] - 7, ts[7:], targets[1:]), targets[1:])
    torch.testing.assert_close(alone, got[7:], **FP32)


def test_paper_input_layer_norm_has_no_affine_and_makes_the_block_scale_invariant():
    layer = _paper(kernel=PADDED)
    assert not any("norm" in name for name, _ in layer.named_parameters())  # no affine weights
    x, offsets, ts, targets = _jagged([6, 4], [1, 1])
    times = _next_times(offsets, ts, targets)
    # Y - X depends on X only through LN(X): scaling and shifting each row leaves it unchanged
    moved = x * 3.0 + 1.5
    torch.testing.assert_close(_paper_out(layer, moved, offsets, times, targets) - moved,
                               _paper_out(layer, x, offsets, times, targets) - x, atol=1e-4, rtol=1e-4)


def test_dlrmv3_n_is_the_batchs_longest_history_plus_most_candidates():
    layer = _dlrmv3(kernel=PADDED).eval()
    x, offsets, ts, targets = _jagged([5, 9], [2, 1])
    times = torch.stack([ts, ts], dim=1)
    params = {k: v.detach() for k, v in _dlrmv3_params(layer).items()}
    width = 8 + 2  # histories 3 and 8, candidates 2 and 1
    got = layer(x, Sequences(offsets, times, targets, max_len=16, longest=width)).detach()
    expected = reference.dlrmv3_stu_layer(x.double(), offsets, params, heads=HEADS, qk_dim=QK, v_dim=DV,
                                          n_norm=width, num_targets=targets)
    torch.testing.assert_close(got.double(), expected, **FP32)
    assert sequence_layout(torch.tensor([3, 8]), torch.tensor([2, 1])).padded_width == width
    with pytest.raises(ValueError, match=r"DLRMv3STU: Sequences.longest=0; it must be the batch's N"):
        layer(x, Sequences(offsets, times, targets, max_len=16))
    other_n = reference.dlrmv3_stu_layer(x.double(), offsets, params, heads=HEADS, qk_dim=QK, v_dim=DV, n_norm=N,
                                         num_targets=targets)
    assert (other_n - expected).abs().max() > 1e-3


@pytest.mark.parametrize("make", [_paper, _dlrmv3])
def test_dropout_acts_in_training_only(make):
    layer = make(kernel=PADDED, dropout=0.5)
    x, offsets, ts, targets = _jagged([6, 4], [1, 1])
    seq = Sequences(offsets, torch.stack([ts, ts], dim=1), targets, max_len=16, longest=10)
    eval_out = layer.eval()(x, seq)
    torch.testing.assert_close(layer(x, seq), eval_out, atol=0, rtol=0)
    torch.manual_seed(0)
    train_out = layer.train()(x, seq)
    assert (train_out - eval_out).abs().max() > 1e-3
    layer.dropout = 0.0
    torch.testing.assert_close(layer(x, seq), eval_out, atol=1e-6, rtol=1e-6)


def test_inits_are_the_references():
    torch.manual_seed(0)
    paper = PaperSTU(64, 4, 32, 32, 200)
    assert paper.uvqk.shape == (64, 4 * 128) and abs(paper.uvqk.std().item() - 0.02) < 2e-3
    assert paper.pos_weights.shape == (399,) and abs(paper.pos_weights.std().item() - 0.02) < 5e-3
    assert paper.time_weights.shape == (129,)
    bound = (6 / (4 * 32 + 64)) ** 0.5  # Xavier-uniform
    assert paper.out.weight.abs().max() <= bound and paper.out.weight.abs().max() > 0.9 * bound
    v3 = DLRMv3STU(64, 4, 32, 32)
    assert v3.output_weight.shape == (3 * 128, 64) and v3.output_weight.abs().max() <= (6 / (384 + 64)) ** 0.5
    assert v3.uvqk_weight.abs().max() <= (6 / (64 + 512)) ** 0.5 and not v3.uvqk_bias.any()
    assert torch.equal(v3.input_norm.weight, torch.ones(64)) and not v3.output_norm.bias.any()
    assert not [n for n, _ in v3.named_parameters() if "pos" in n or "time" in n]  # no relative bias


def test_presets_select_the_variants_and_old_records_load_the_legacy_layer():
    from torchrec_tpu.hstu.dlrmv4 import DLRMv4, DLRMv4Config

    assert preset("hstu", 10, 3).stu == "paper" and list(PRESETS) == ["hstu"]  # dlrmv4 is MLPerf's model
    small = DLRMv4Config(dim=16, layers=1, heads=2, qk_dim=4, v_dim=4, max_seq_len=64, max_rows=50)
    assert isinstance(DLRMv4(small).stack.layers[0], DLRMv3STU)
    assert preset("hstu", 10, 3, stu="dlrmv3").stu == "dlrmv3"
    old = HSTUConfig(item_rows=10, action_rows=3).to_dict()
    del old["stu"], old["dropout"]
    assert HSTUConfig.from_dict(old).stu == "legacy" and HSTUConfig.from_dict(old).dropout == 0.0
    assert isinstance(HSTU(HSTUConfig.from_dict(old)).stack.layers[0], LegacySTU)
    with pytest.raises(ValueError, match=r"HSTUConfig.stu='v2'; expected one of \['paper', 'dlrmv3', 'legacy'\]"):
        HSTUConfig(item_rows=10, action_rows=3, stu="v2")


def _reference_model(model, kjt):
    """Per user: tokens from the EC's tables, history then candidates through the reference layers of
    the model's variant, the candidates' rows through the heads."""
    f, c = kjt.to_dict(), model.config
    item_w = model.embeddings.embeddings["item"].weight.double()
    action_w = model.embeddings.embeddings["action"].weight.double()
    hist_len, cand_len = f["item"].lengths(), f["candidate_item"].lengths()
    hist_off = torch.cat([torch.zeros(1, dtype=torch.int64), hist_len.cumsum(0)])
    cand_off = torch.cat([torch.zeros(1, dtype=torch.int64), cand_len.cumsum(0)])
    width = int(hist_len.max() + cand_len.max())
    rows = []
    for b in range(kjt.stride()):
        h, cs = slice(hist_off[b], hist_off[b + 1]), slice(cand_off[b], cand_off[b + 1])
        x = torch.cat([item_w[f["item"].values()[h]] + action_w[f["action"].values()[h]],
                       item_w[f["candidate_item"].values()[cs]]])
        ts = torch.cat([f["timestamp"].values()[h], f["candidate_timestamp"].values()[cs]])
        offsets, targets = torch.tensor([0, x.shape[0]]), torch.tensor([cs.stop - cs.start])
        for layer in model.stack.layers:
            if c.stu == "paper":
                x = reference.paper_stu_layer(x, offsets, ts, _paper_params(layer), heads=c.heads, qk_dim=c.qk_dim,
                                              v_dim=c.v_dim, max_seq_len=c.max_seq_len, num_targets=targets)
            else:
                x = reference.dlrmv3_stu_layer(x, offsets, _dlrmv3_params(layer), heads=c.heads, qk_dim=c.qk_dim,
                                               v_dim=c.v_dim, n_norm=width, num_targets=targets)
        rows.append(x[x.shape[0] - targets[0]:])
    return model.heads.double()(torch.cat(rows)).float()


@pytest.mark.parametrize("stu", ["paper", "dlrmv3"])
@pytest.mark.parametrize("kernel,jagged_from", [("xla", 1), (PADDED, 1)])
def test_model_of_each_variant_scores_candidates_like_the_reference(stu, kernel, jagged_from, monkeypatch):
    monkeypatch.setattr(attention, "CPU_JAGGED_FROM", jagged_from)
    config = HSTUConfig(item_rows=30, action_rows=3, dim=DIM, layers=2, heads=HEADS, qk_dim=QK, v_dim=DV,
                        max_seq_len=N, tasks=("a", "b"), head_hidden=8, kernel=kernel, stu=stu, dropout=0.3)
    torch.manual_seed(0)
    model = HSTU(config).eval()
    kjt = batch_kjt([4, 0, 9, 1], [2, 1, 3, 1], config)
    got = model(kjt)
    expected = _reference_model(model, kjt)
    assert got.shape == (7, 2)
    torch.testing.assert_close(got.detach(), expected.detach(), **FP32)
