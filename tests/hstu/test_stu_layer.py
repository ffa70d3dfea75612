"""The ``legacy`` STU layer (this project's first; test_stu_variants.py tests Meta's two) and the
HSTU model of it equal the plain-PyTorch reference written from its equations
(tests/hstu/reference.py), on CPU (with the jagged op on the tpu device, and plain PyTorch with the
padded attention) and on the tpu device, forward and gradients, fp32 to 1e-5, bf16 within stated
tolerances."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torch_tpu  # noqa: F401  (the tpu device)
from tests.hstu import reference
from tests.hstu.batches import batch_kjt
from torch_tpu.ops.hstu.jagged import packed_jagged_hstu_attention
from torchrec_tpu.hstu import attention
from torchrec_tpu.hstu.attention import CPU_JAGGED_FROM, PADDED, hstu_attention, stu_attention
from torchrec_tpu.hstu.config import HSTUConfig
from torchrec_tpu.hstu.layers import LegacySTU, Sequences
from torchrec_tpu.hstu.model import HSTU

DIM, HEADS, QK, DV, MAX_SEQ_LEN = 12, 2, 4, 3, 32


def _layer(seed=0, kernel="xla"):
    torch.manual_seed(seed)
    layer = LegacySTU(DIM, HEADS, QK, DV, MAX_SEQ_LEN, time_buckets=12, kernel=kernel)
    with torch.no_grad():  # random biases and norm, so every term is exercised
        for p in (layer.pos_weights, layer.time_weights, layer.norm.weight, layer.norm.bias):
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p is layer.norm.weight else 0.0))
    return layer


def _params(layer, dtype=torch.float64):
    named = {"w1": layer.uvqk.weight.T, "b1": layer.uvqk.bias, "w2": layer.out.weight.T, "b2": layer.out.bias,
             "pos_w": layer.pos_weights, "ts_w": layer.time_weights, "ln_w": layer.norm.weight, "ln_b": layer.norm.bias}
    return {k: v.detach().to(dtype).requires_grad_() for k, v in named.items()}


def _jagged(lengths, targets, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    x = torch.randn(int(lengths.sum()), DIM, generator=gen)
    ts = 1_600_000_000 + torch.randint(0, 9000, (x.shape[0],), generator=gen).cumsum(0)
    return x, offsets, ts, torch.tensor(targets)


# grads of the layer's parameters, as named in _params
_GRADS = {"w1": lambda m: m.uvqk.weight.grad.T, "b1": lambda m: m.uvqk.bias.grad, "w2": lambda m: m.out.weight.grad.T,
          "b2": lambda m: m.out.bias.grad, "pos_w": lambda m: m.pos_weights.grad,
          "ts_w": lambda m: m.time_weights.grad, "ln_w": lambda m: m.norm.weight.grad,
          "ln_b": lambda m: m.norm.bias.grad}


def _close(got, expected, tol, what):
    if tol is None:  # bf16: 8 mantissa bits, sums over rows in bf16; 3% of the tensor's norm
        error = (got.cpu().double() - expected).norm() / expected.norm().clamp(min=1e-12)
        assert error < 3e-2, f"{what}: relative error {error:.3g} (bf16 tolerance 3e-2)"
    else:
        torch.testing.assert_close(got.cpu().double(), expected, **tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("device,dtype,tol,kernel,max_len", [
    ("cpu", torch.float32, dict(atol=1e-5, rtol=1e-5), "xla", CPU_JAGGED_FROM),  # CPU layer, jagged op on tpu
    ("cpu", torch.float32, dict(atol=1e-5, rtol=1e-5), "xla", 16),  # a short CPU batch: padded attention
    ("cpu", torch.float32, dict(atol=1e-5, rtol=1e-5), PADDED, CPU_JAGGED_FROM),  # plain PyTorch (the baseline)
    # (the model test below runs the STU stack on tpu by default; this one compiles every layer op anew)
    pytest.param("tpu", torch.float32, dict(atol=1e-5, rtol=1e-5), "xla", 16, marks=pytest.mark.slow),
    pytest.param("tpu", torch.bfloat16, None, "xla", 16, marks=pytest.mark.slow),
])
def test_stu_layer_matches_reference(device, dtype, tol, kernel, max_len):
    layer = _layer(kernel=kernel)
    x, offsets, ts, targets = _jagged([0, 1, 6, 13, 2], [0, 1, 2, 3, 0])
    params = _params(layer)
    ref_x = x.double().requires_grad_()
    expected = reference.stu_layer(ref_x, offsets, ts, params, heads=HEADS, qk_dim=QK, v_dim=DV,
                                   max_seq_len=MAX_SEQ_LEN, num_targets=targets)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected.backward(grad)

    ours = layer.to(device=device, dtype=dtype)
    got_x = x.to(device=device, dtype=dtype).requires_grad_()
    seq = Sequences(offsets.to(device), ts.to(device), targets.to(device), max_len=max_len)
    got = ours(got_x, seq)
    assert got.dtype == dtype
    _close(got, expected.detach(), tol, "output")
    got.backward(grad.to(device=device, dtype=dtype))
    _close(got_x.grad, ref_x.grad, tol, "dx")
    for name, read in _GRADS.items():
        _close(read(ours), params[name].grad, tol, f"d{name}")


class _DeviceMoves(TorchDispatchMode):
    """Records every floating tensor an op moves between devices (forward and autograd's backward)."""

    def __init__(self):
        super().__init__()
        self.moves = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (isinstance(out, torch.Tensor) and src is not None and out.is_floating_point()
                and out.device.type != src.device.type):
            self.moves.append(f"{src.device.type}->{out.device.type} {list(out.shape)}")
        return out


def _cpu_layer_attention(layer, x, seq, grad, packed):
    """The layer's attention of ``x`` on CPU, packed (:func:`stu_attention`) or by q, k, v
    (:func:`hstu_attention`): the output, the gradients of x, the linear and both bias tables,
    and the floating tensors moved between devices."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    hv, hq = HEADS * DV, HEADS * QK
    h = F.silu(layer.uvqk(x))[:, hv:]
    kwargs = dict(max_len=seq.max_len, max_seq_len=MAX_SEQ_LEN, alpha=1 / math.sqrt(QK))
    with _DeviceMoves() as moves:
        if packed:
            out = stu_attention(h, seq.offsets, seq.timestamps, seq.num_targets, layer.pos_weights,
                                layer.time_weights, heads=HEADS, qk_dim=QK, **kwargs)
        else:
            v, q, k = torch.split(h, [hv, hq, hq], dim=-1)
            out = hstu_attention(q.reshape(-1, HEADS, QK), k.reshape(-1, HEADS, QK), v.reshape(-1, HEADS, DV),
                                 seq.offsets, seq.timestamps, seq.num_targets, layer.pos_weights, layer.time_weights,
                                 **kwargs)
        out.backward(grad)
    grads = {"x": x.grad, "w1": layer.uvqk.weight.grad, "b1": layer.uvqk.bias.grad,
             "pos_w": layer.pos_weights.grad, "ts_w": layer.time_weights.grad}
    return out.detach(), grads, moves.moves


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_cpu_attention_equals_the_unpacked_op_with_half_the_device_moves(dtype):
    layer = _layer().to(dtype)
    x, offsets, ts, targets = _jagged([0, 1, 6, 13, 2, 1], [0, 1, 2, 3, 0, 0])
    seq = Sequences(offsets.to("tpu"), ts.to("tpu"), targets.to("tpu"), max_len=CPU_JAGGED_FROM)
    grad = torch.randn(x.shape[0], HEADS, DV, generator=torch.Generator().manual_seed(5)).to(dtype)
    out, grads, moves = _cpu_layer_attention(layer, x.to(dtype), seq, grad, packed=True)
    expected, expected_grads, unpacked_moves = _cpu_layer_attention(layer, x.to(dtype), seq, grad, packed=False)
    assert out.device.type == "cpu" and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert expected.abs().max() > 0 and expected_grads["ts_w"].abs().max() > 0  # the comparison is not of zeros
    for name, g in expected_grads.items():
        assert grads[name].device.type == "cpu", name
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-6, msg=lambda m: f"d{name}: {m}")
    # forward: vqk and the bias tables over, the output back; backward: its gradient over, 2 back
    rows, width, tables = x.shape[0], HEADS * (DV + 2 * QK), MAX_SEQ_LEN + 13
    assert sorted(moves) == sorted([f"cpu->tpu [{rows}, {width}]", f"cpu->tpu [{tables}]",
                                    f"tpu->cpu [{rows}, {HEADS}, {DV}]", f"cpu->tpu [{rows}, {HEADS}, {DV}]",
                                    f"tpu->cpu [{rows}, {width}]", f"tpu->cpu [{tables}]"])
    assert len(unpacked_moves) == 12


def test_packed_op_refuses_bad_shapes_by_name():
    vqk = torch.zeros(5, HEADS * (DV + 2 * QK)).to("tpu")
    offsets, ts, targets = torch.tensor([0, 5]).to("tpu"), torch.arange(5).to("tpu"), torch.tensor([0]).to("tpu")
    kwargs = dict(max_len=8, max_seq_len=8, alpha=1.0, num_targets=targets)
    with pytest.raises(ValueError, match=r"packed_jagged_hstu_attention: vqk must be \[T, heads \* \(v_dim \+ 2 "
                                         r"\* qk_dim\)\] with heads=2, qk_dim=9; got \[5, 22\]"):
        packed_jagged_hstu_attention(vqk, offsets, ts, torch.zeros(9).to("tpu"), heads=HEADS, qk_dim=9,
                                     pos_buckets=4, **kwargs)
    with pytest.raises(ValueError, match=r"longer than pos_buckets=9; got \[9\]"):
        packed_jagged_hstu_attention(vqk, offsets, ts, torch.zeros(9).to("tpu"), heads=HEADS, qk_dim=QK,
                                     pos_buckets=9, **kwargs)
    with pytest.raises(ValueError, match=r"packed_jagged_hstu_attention: a sequence has 5 events, above max_len=4"):
        packed_jagged_hstu_attention(vqk, offsets, ts, torch.zeros(9).to("tpu"), heads=HEADS, qk_dim=QK,
                                     pos_buckets=4, **{**kwargs, "max_len": 4})


def _reference_model(model, kjt):
    """Per user: tokens from the EC's tables, history then candidates through reference STU layers,
    the candidates' rows through the heads."""
    f = kjt.to_dict()
    item_w = model.embeddings.embeddings["item"].weight.double()
    action_w = model.embeddings.embeddings["action"].weight.double()
    hist_off = torch.cat([torch.zeros(1, dtype=torch.int64), f["item"].lengths().cumsum(0)])
    cand_off = torch.cat([torch.zeros(1, dtype=torch.int64), f["candidate_item"].lengths().cumsum(0)])
    rows = []
    for b in range(kjt.stride()):
        h, c = slice(hist_off[b], hist_off[b + 1]), slice(cand_off[b], cand_off[b + 1])
        x = torch.cat([item_w[f["item"].values()[h]] + action_w[f["action"].values()[h]],
                       item_w[f["candidate_item"].values()[c]]])
        ts = torch.cat([f["timestamp"].values()[h], f["candidate_timestamp"].values()[c]])
        offsets = torch.tensor([0, x.shape[0]])
        targets = torch.tensor([c.stop - c.start])
        for layer in model.stack.layers:
            x = reference.stu_layer(x, offsets, ts, _params(layer), heads=model.config.heads,
                                    qk_dim=model.config.qk_dim, v_dim=model.config.v_dim,
                                    max_seq_len=model.config.max_seq_len, num_targets=targets)
        rows.append(x[x.shape[0] - targets[0]:])
    return model.heads.double()(torch.cat(rows)).float()


@pytest.mark.parametrize("device,kernel,jagged_from", [
    ("cpu", "xla", 1),  # CPU stack, every batch through the jagged op on tpu
    ("cpu", "xla", CPU_JAGGED_FROM),  # CPU stack, these short batches through the padded attention
    ("cpu", PADDED, 1), ("tpu", "xla", CPU_JAGGED_FROM)])
def test_model_scores_each_users_candidates_like_the_reference(device, kernel, jagged_from, monkeypatch):
    monkeypatch.setattr(attention, "CPU_JAGGED_FROM", jagged_from)
    config = HSTUConfig(item_rows=30, action_rows=3, dim=DIM, layers=2, heads=HEADS, qk_dim=QK, v_dim=DV,
                        max_seq_len=MAX_SEQ_LEN, tasks=("a", "b"), head_hidden=8, kernel=kernel, stu="legacy")
    torch.manual_seed(0)
    model = HSTU(config, dense_device=device)
    with torch.no_grad():
        for layer in model.stack.layers:
            layer.pos_weights.normal_(0, 0.5)
            layer.time_weights.normal_(0, 0.5)
    kjt = batch_kjt([4, 0, 9, 1], [2, 1, 3, 1], config)
    got = model(kjt)
    cpu_model = HSTU(config)
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    expected = _reference_model(cpu_model, kjt)
    assert got.shape == (7, 2)
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5)


def test_bad_batches_are_refused_by_name():
    config = HSTUConfig(item_rows=30, action_rows=3, dim=DIM, heads=HEADS, qk_dim=QK, v_dim=DV, max_seq_len=8)
    model = HSTU(config)
    with pytest.raises(ValueError, match=r"9 history events \+ candidates, above max_seq_len=8"):
        model(batch_kjt([8, 2], [1, 1], config))
    kjt = batch_kjt([2, 2], [1, 1], config)
    bad = KeyedJaggedTensor.from_jt_dict({k: v for k, v in kjt.to_dict().items() if k != "action"})
    with pytest.raises(ValueError, match=r"missing \['action'\]"):
        model(bad)
