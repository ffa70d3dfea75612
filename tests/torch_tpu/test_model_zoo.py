"""The model zoo: stock torch.nn / torchrec models trained 3 steps on tpu and on CPU from the same
init, with SGD and with AdamW, eagerly (strict mode, zero CPU fallbacks) and under
``torch.compile(backend="tpu")``: losses, parameters with non-zero gradients and eval outputs
agree within 1e-5.

Default run: every family eagerly with both optimizers, and compiled with AdamW (the masked
variant of the Transformer families); the other compiled cases are marked slow.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import torch_tpu
import torch_tpu.compile  # noqa: F401  (registers backend="tpu")

STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-5)
_NOISE = 1e-6  # gradient magnitude below which an element counts as having no gradient
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


@dataclass
class Family:
    make: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple]  # CPU tensors, one batch
    call: Callable[[nn.Module, tuple], torch.Tensor] = lambda model, xs: model(*xs)
    eval_check: bool = False  # compare eval-mode outputs after training (BatchNorm, fast paths)
    # positions eval outputs are compared at, when compiled: PyTorch's own TransformerEncoder skips
    # its nested-tensor path under torch.compile, so padded positions hold values there (any device)
    compiled_eval_valid: Callable[[tuple], torch.Tensor] | None = None


class Head(nn.Module):
    """A sequence model (its first output) followed by a linear head."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)[0])


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, key_padding_mask=key_padding_mask)[0]


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.bags = nn.ModuleList(nn.EmbeddingBag(10, 4, mode=m) for m in ("sum", "mean", "max"))
        self.head = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pooled = [bag(values, offsets) for bag in self.bags]
        return self.head(torch.cat([self.embedding(ids).sum(1), *pooled], dim=1))


def _padding(g: torch.Generator, batch: int = 2, length: int = 5) -> torch.Tensor:
    """A left-aligned key padding mask (True: padding) with one full and one padded sequence."""
    lengths = torch.tensor([length, 3])[:batch]
    return torch.arange(length)[None, :] >= lengths[:, None]


def _encoder(nested: bool = True) -> nn.Module:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)


def _decoder() -> nn.Module:
    return nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2)


def _valid(xs: tuple) -> torch.Tensor:
    return ~xs[1]


_F, _B = 3, 4


def _dlrm(dcn: bool) -> nn.Module:
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"])
              for i in range(_F)]
    ebc = EmbeddingBagCollection(tables=tables)
    if dcn:
        return DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=5, dense_arch_layer_sizes=[8, 4],
                        over_arch_layer_sizes=[8, 1], dcn_num_layers=2, dcn_low_rank_dim=2)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=5, dense_arch_layer_sizes=[8, 4],
                over_arch_layer_sizes=[8, 1])


def _dlrm_inputs(g: torch.Generator) -> tuple:
    lengths = torch.randint(0, 3, (_F * _B,), generator=g)  # empty bags included
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    return torch.randn(_B, 5, generator=g), values, lengths


def _dlrm_call(model: nn.Module, xs: tuple) -> torch.Tensor:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dense, values, lengths = xs
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(_F)], values=values, lengths=lengths)
    return model(dense, kjt)


FAMILIES: dict[str, Family] = {
    "mlp_layernorm_gelu": Family(
        lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3)),
        lambda g: (torch.randn(4, 6, generator=g),)),
    "cnn_batchnorm_maxpool": Family(
        # no conv bias before BatchNorm: its gradient is zero up to rounding, and AdamW would turn
        # that noise into device-dependent steps that reach the running mean (the eval outputs)
        lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)),
        lambda g: (torch.randn(2, 1, 8, 8, generator=g),), eval_check=True),
    "lstm_2layer_batch_first": Family(
        lambda: Head(nn.LSTM(4, 6, 2, batch_first=True), 6), lambda g: (torch.randn(2, 3, 4, generator=g),)),
    "gru_2layer_batch_first": Family(
        lambda: Head(nn.GRU(4, 6, 2, batch_first=True), 6), lambda g: (torch.randn(2, 3, 4, generator=g),)),
    "transformer_encoder": Family(
        _encoder, lambda g: (torch.randn(2, 5, 8, generator=g),), eval_check=True),
    "transformer_encoder_padding_mask": Family(
        _encoder, lambda g: (torch.randn(2, 5, 8, generator=g), _padding(g)),
        call=lambda model, xs: model(xs[0], src_key_padding_mask=xs[1]), eval_check=True,
        compiled_eval_valid=_valid),
    "transformer_decoder": Family(
        _decoder, lambda g: (torch.randn(2, 4, 8, generator=g), torch.randn(2, 5, 8, generator=g)),
        call=lambda model, xs: model(xs[0], xs[1], tgt_mask=nn.Transformer.generate_square_subsequent_mask(
            4, device=xs[0].device), tgt_is_causal=True), eval_check=True),
    "transformer_decoder_padding_masks": Family(
        _decoder, lambda g: (torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g), _padding(g)),
        call=lambda model, xs: model(xs[0], xs[1], tgt_key_padding_mask=xs[2], memory_key_padding_mask=xs[2]),
        eval_check=True),
    "multihead_attention": Family(
        SelfAttention, lambda g: (torch.randn(2, 5, 8, generator=g), _padding(g)), eval_check=True),
    "embedding_and_bags": Family(
        Embeddings, lambda g: (torch.randint(0, 10, (3, 2), generator=g), torch.randint(0, 10, (7,), generator=g),
                               torch.tensor([0, 2, 2])), eval_check=False),
    "torchrec_dlrm": Family(lambda: _dlrm(dcn=False), _dlrm_inputs, call=_dlrm_call),
    "torchrec_dlrm_dcn": Family(lambda: _dlrm(dcn=True), _dlrm_inputs, call=_dlrm_call),
}


def _loss(out: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.0, out.numel(), device=out.device).reshape(out.shape)
    return (out * weights).sum() + (out * out).mean()


def _train(family: Family, model: nn.Module, run: Callable, optimizer: str, batches: list, device: str):
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    losses = []
    for xs in batches:
        opt.zero_grad()
        loss = _loss(family.call(run, tuple(x.to(device) for x in xs)))
        loss.backward()
        opt.step()
        losses.append(loss.detach().to("cpu"))
    return losses


def _check(name: str, optimizer: str, compiled: bool) -> None:
    family = FAMILIES[name]
    torch.manual_seed(0)
    cpu = family.make()
    tpu = copy.deepcopy(cpu).to("tpu")
    g = torch.Generator().manual_seed(1)
    batches = [family.inputs(g) for _ in range(STEPS)]
    run = torch.compile(tpu, backend="tpu", dynamic=False) if compiled else tpu
    torch_tpu.reset_metrics()
    if compiled:
        actual = _train(family, tpu, run, optimizer, batches, "tpu")
    else:
        with torch_tpu.no_fallback():  # eager strict: an unlowered op raises instead of running on CPU
            actual = _train(family, tpu, tpu, optimizer, batches, "tpu")
        assert torch_tpu.fallback_counts() == {}, torch_tpu.metrics_report()
    expected = _train(family, cpu, cpu, optimizer, batches, "cpu")
    torch.testing.assert_close(torch.stack(actual), torch.stack(expected), **TOL, msg=lambda m: f"losses: {m}")
    checked = 0
    for (pname, p), q in zip(cpu.named_parameters(), tpu.parameters()):
        # Elements with a non-zero gradient. Some are zero only up to rounding (attention's key bias
        # cannot change the softmax): Adam-type updates turn that noise into +-lr steps whose sign
        # is the noise's, on any two devices.
        moved = p.grad.abs() > _NOISE if p.grad is not None else None
        if moved is None or not moved.any():
            continue
        torch.testing.assert_close(q.detach().cpu()[moved], p.detach()[moved], **TOL,
                                   msg=lambda m: f"{pname}: {m}")
        checked += 1
    assert checked, "no parameter had a non-zero gradient"
    if family.eval_check:
        _check_eval(family, cpu, tpu, run, batches[0], compiled)


def _check_eval(family: Family, cpu: nn.Module, tpu: nn.Module, run: Callable, xs: tuple, compiled: bool) -> None:
    cpu.eval()
    tpu.eval()
    with torch.no_grad():
        expected = family.call(cpu, xs)
        if compiled:
            actual = family.call(run, tuple(x.to("tpu") for x in xs)).cpu()
        else:
            torch_tpu.reset_metrics()
            with torch_tpu.no_fallback():
                actual = family.call(tpu, tuple(x.to("tpu") for x in xs)).cpu()
            assert torch_tpu.fallback_counts() == {}, torch_tpu.metrics_report()
    if compiled and family.compiled_eval_valid is not None:
        keep = family.compiled_eval_valid(xs)
        actual, expected = actual[keep], expected[keep]
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"eval outputs: {m}")


def _params(slow: Callable[[str, str], bool] = lambda name, opt: False) -> list:
    return [
        pytest.param(name, opt, id=f"{name}-{opt}", marks=[pytest.mark.slow] if slow(name, opt) else [])
        for name in FAMILIES for opt in OPTIMIZERS
    ]


# Compiled, the default run keeps one case per family (AdamW; the masked Transformer variants).
_COMPILED_SLOW = {"transformer_encoder", "transformer_decoder"}


@pytest.mark.parametrize(("name", "optimizer"), _params())
def test_zoo_eager_strict(name, optimizer):
    _check(name, optimizer, compiled=False)


@pytest.mark.parametrize(("name", "optimizer"), _params(lambda name, opt: opt == "sgd" or name in _COMPILED_SLOW))
def test_zoo_compiled(name, optimizer):
    torch._dynamo.reset()
    try:
        _check(name, optimizer, compiled=True)
    finally:
        torch._dynamo.reset()
