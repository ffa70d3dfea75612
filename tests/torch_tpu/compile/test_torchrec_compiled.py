"""Stock torchrec DLRM (EmbeddingBagCollection, KJT input) compiled on tpu: forward and backward == CPU."""

import copy

import torch

import torch_tpu.compile as tc
from tests.torch_tpu.torchrec_dlrm_case import DlrmBatch, one_table_per_feature

B, F, D, DENSE_IN = 6, 3, 8, 5


def test_torchrec_dlrm_compiled_forward_backward_matches_cpu():
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    keys, tables = one_table_per_feature(F, D)
    torch.manual_seed(0)
    cpu = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=DENSE_IN,
               dense_arch_layer_sizes=[16, D], over_arch_layer_sizes=[16, 1])
    tpu = copy.deepcopy(cpu).to("tpu")
    batch = DlrmBatch.random(keys, B, DENSE_IN)

    expected = batch.loss(cpu, "cpu")
    expected.backward()
    compiled = torch.compile(tpu, backend="tpu")
    actual = batch.loss(compiled, "tpu")
    actual.backward()
    kinds = {g.kind for g in tc.compiled_graphs()}
    assert {"forward", "backward"} <= kinds, kinds
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(cpu.named_parameters(), tpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
