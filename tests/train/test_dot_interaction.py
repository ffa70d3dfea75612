"""The host towers' dot interaction against TorchRec's ``InteractionArch`` (the reference)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchrec.models.dlrm import DLRM_DCN, InteractionArch

from torchrec_tpu.train.engines.dense_placement import place_dense
from torchrec_tpu.train.engines.dot_interaction import OneMatmulInteractionArch, use_one_matmul_interaction
from torchrec_tpu.train.model import ModelSpec, build_dlrm


def _holder(arch: InteractionArch) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.inter_arch = arch
    return holder


def _inputs(batch: int, features: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, dim, generator=generator, requires_grad=True),
            torch.randn(batch, features, dim, generator=generator, requires_grad=True))


def _run(arch: InteractionArch, dense: torch.Tensor, sparse: torch.Tensor, grad_seed: int,
         autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dense, sparse = (t.detach().clone().requires_grad_() for t in (dense, sparse))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = arch(dense, sparse)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)))
    return out.detach(), dense.grad, sparse.grad


@pytest.mark.parametrize("batch,features,dim", [(8, 26, 16), (5, 3, 7), (4, 1, 4), (33, 12, 64)])
def test_outputs_are_torchrecs_bit_for_bit_and_gradients_within_rounding(batch, features, dim) -> None:
    stock, fast = InteractionArch(features), InteractionArch(features)
    use_one_matmul_interaction(_holder(fast))
    assert type(fast) is OneMatmulInteractionArch
    dense, sparse = _inputs(batch, features, dim, seed=features)
    want, got = _run(stock, dense, sparse, 1), _run(fast, dense, sparse, 1)
    assert got[0].shape == (batch, dim + features * (features + 1) // 2)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)


def test_under_bf16_autocast_it_computes_as_torchrecs_does() -> None:
    stock, fast = InteractionArch(26), InteractionArch(26)
    use_one_matmul_interaction(_holder(fast))
    dense, sparse = _inputs(16, 26, 32, seed=3)
    want, got = _run(stock, dense, sparse, 2, autocast=True), _run(fast, dense, sparse, 2, autocast=True)
    assert got[0].dtype == want[0].dtype == torch.float32
    assert torch.equal(got[0], want[0])  # the same bf16 matmul, its pairs promoted alike
    assert got[2].dtype == torch.float32
    # bf16 backward: TorchRec rounds each of its two products, this one their sum
    torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=2e-2 * want[2].abs().max().item())


def test_no_sparse_features_returns_the_dense_ones() -> None:
    fast = InteractionArch(0)
    use_one_matmul_interaction(_holder(fast))
    dense = torch.randn(3, 4)
    assert fast(dense, torch.zeros(3, 0, 4)) is dense


def test_host_placement_swaps_only_dot_interactions_and_keeps_the_state_dict() -> None:
    spec = ModelSpec(feature_names=("a", "b", "c"), table_sizes=(5, 6, 7), embedding_dim=4, dense_in_features=3,
                     dense_layers=(8, 4), over_layers=(8, 1))
    model = build_dlrm(spec, torch.device("cpu"))
    keys = set(model.state_dict())
    place_dense(model, torch.device("cpu"))
    assert type(model.model.inter_arch) is OneMatmulInteractionArch
    assert set(model.state_dict()) == keys
    dcn = build_dlrm(dataclasses.replace(spec, dcn_num_layers=2, dcn_low_rank_dim=2), torch.device("cpu"))
    assert isinstance(dcn.model, DLRM_DCN)
    cross = type(dcn.model.inter_arch)
    place_dense(dcn, torch.device("cpu"))
    assert type(dcn.model.inter_arch) is cross  # DCN's cross net keeps its own
