"""Training on tpu matches CPU: DLRM dense/over/interaction arches, DCNv2, MLP, every optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet

import torch_tpu
from tests.torch_tpu.torchrec_dlrm_case import DlrmBatch, one_table_per_feature

B, D, F, DENSE_IN = 16, 8, 3, 13


class DenseDLRM(torch.nn.Module):
    """DLRM minus its embeddings (they stay on CPU/SparseCore): dense arch, interaction, DCN, over arch."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = DenseArch(DENSE_IN, [16, D])
        self.inter = InteractionArch(num_sparse_features=F)
        self.cross = LowRankCrossNet(in_features=D * (F + 1), num_layers=2, low_rank=4)
        self.over = OverArch(D + F * (F + 1) // 2 + D * (F + 1), [16, 1])

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        d = self.dense(dense)
        crossed = self.cross(torch.cat([d, sparse.reshape(sparse.shape[0], -1)], dim=1))
        return self.over(torch.cat([self.inter(d, sparse), crossed], dim=1)).squeeze(-1)


OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.Adagrad, {"lr": 0.05}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]


def _batches(steps: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(B, DENSE_IN, generator=g), torch.randn(B, F, D, generator=g),
         torch.randint(0, 2, (B,), generator=g).float())
        for _ in range(steps)
    ]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches, device: str) -> list[float]:
    losses = []
    for dense, sparse, labels in batches:
        logits = model(dense.to(device), sparse.to(device))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# Each optimizer runs once by default (alternating single-tensor / foreach); the rest is slow.
CASES = [
    pytest.param(opt_cls, kwargs, foreach, id=f"{opt_cls.__name__}-{'foreach' if foreach else 'single'}",
                 marks=() if foreach == (i % 2 == 1) else pytest.mark.slow)
    for i, (opt_cls, kwargs) in enumerate(OPTIMIZERS)
    for foreach in (False, True)
]


@pytest.mark.parametrize("opt_cls,opt_kwargs,foreach", CASES)
def test_dlrm_dense_training_matches_cpu(opt_cls, opt_kwargs, foreach) -> None:
    torch.manual_seed(0)
    cpu_model = DenseDLRM()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    assert all(p.device.type == "tpu" for p in tpu_model.parameters())
    batches = _batches(4)
    cpu_losses = _train(cpu_model, opt_cls(cpu_model.parameters(), foreach=foreach, **opt_kwargs), batches, "cpu")
    torch_tpu.reset_metrics()
    tpu_losses = _train(tpu_model, opt_cls(tpu_model.parameters(), foreach=foreach, **opt_kwargs), batches, "tpu")
    assert torch_tpu.fallback_counts() == {}, torch_tpu.metrics_report()
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-5, atol=1e-5)
    for (name, p_cpu), p_tpu in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(p_tpu.detach().cpu(), p_cpu.detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert cpu_losses[-1] != cpu_losses[0]  # the loop really trained


def test_mlp_bce_auc_and_clip_grad_norm_without_fallback() -> None:
    torch.manual_seed(1)
    cpu = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Dropout(0.0),
                              torch.nn.Linear(32, 1), torch.nn.Sigmoid())
    tpu = copy.deepcopy(cpu).to("tpu")
    x, y = torch.randn(64, 10), torch.randint(0, 2, (64,)).float()
    with torch_tpu.no_fallback():
        for model, dev in ((cpu, "cpu"), (tpu, "tpu")):
            p = model(x.to(dev)).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy(p, y.to(dev))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            model.norm = norm.cpu()
            model.auc = binary_auroc(p.detach(), y.long().to(dev)).cpu()
    torch.testing.assert_close(tpu.norm, cpu.norm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tpu.auc, cpu.auc, rtol=1e-6, atol=1e-6)
    for a, b in zip(cpu.parameters(), tpu.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-5, atol=1e-6)


def test_state_dict_save_load_weights_only(tmp_path) -> None:
    model = torch.nn.Linear(4, 3).to("tpu")
    model.weight.data.mul_(2)
    state = {"model": model.state_dict(), "bf16": torch.arange(5.0, device="tpu").to(torch.bfloat16)}
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    for key, value in model.state_dict().items():
        assert loaded["model"][key].device.type == "tpu"
        torch.testing.assert_close(loaded["model"][key].cpu(), value.cpu(), rtol=0, atol=0)
    assert loaded["bf16"].dtype == torch.bfloat16 and loaded["bf16"].device.type == "tpu"
    torch.testing.assert_close(loaded["bf16"].cpu(), torch.arange(5.0).to(torch.bfloat16))
    fresh = torch.nn.Linear(4, 3).to("tpu")
    fresh.load_state_dict(loaded["model"])
    torch.testing.assert_close(fresh.weight.detach().cpu(), model.weight.detach().cpu())


@pytest.mark.slow
def test_torchrec_dlrm_dcn_with_embedding_bags_trains_on_tpu_without_fallback() -> None:
    """The whole torchrec DLRM_DCN (EmbeddingBagCollection, KJT input included) on tpu: one Adagrad step."""
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    keys, tables = one_table_per_feature(F, D)
    torch.manual_seed(0)
    cpu_model = DLRM_DCN(embedding_bag_collection=EmbeddingBagCollection(tables=tables),
                         dense_in_features=DENSE_IN, dense_arch_layer_sizes=[16, D], over_arch_layer_sizes=[16, 1],
                         dcn_num_layers=2, dcn_low_rank_dim=4)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    batch = DlrmBatch.random(keys, B, DENSE_IN)

    def step(model, device):
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        loss = batch.loss(model, device)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    cpu_loss = step(cpu_model, "cpu")
    torch_tpu.reset_metrics()
    with torch_tpu.no_fallback():
        tpu_loss = step(tpu_model, "tpu")
    assert torch_tpu.lowered_counts().get("_embedding_bag.default", 0) == F
    assert abs(tpu_loss - cpu_loss) < 1e-5
    for (name, p_cpu), p_tpu in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(p_tpu.detach().cpu(), p_cpu.detach(), rtol=1e-5, atol=1e-6, msg=name)
