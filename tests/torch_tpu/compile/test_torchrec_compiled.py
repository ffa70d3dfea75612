"""Stock torchrec DLRM (EmbeddingBagCollection, KJT input) compiled on tpu: forward and backward == CPU."""

import copy

import torch

import torch_tpu.compile as tc

B, F, D, DENSE_IN = 6, 3, 8, 5


def test_torchrec_dlrm_compiled_forward_backward_matches_cpu():
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f"f{i}" for i in range(F)]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=20, feature_names=[k])
              for i, k in enumerate(keys)]
    torch.manual_seed(0)
    cpu = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=DENSE_IN,
               dense_arch_layer_sizes=[16, D], over_arch_layer_sizes=[16, 1])
    tpu = copy.deepcopy(cpu).to("tpu")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (F * B,), generator=g)  # empty bags included
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    dense, labels = torch.randn(B, DENSE_IN, generator=g), torch.randint(0, 2, (B,), generator=g).float()

    def loss_of(model, device):
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values.to(device), lengths=lengths.to(device))
        logits = model(dense.to(device), kjt).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device))

    expected = loss_of(cpu, "cpu")
    expected.backward()
    compiled = torch.compile(tpu, backend="tpu")
    actual = loss_of(compiled, "tpu")
    actual.backward()
    kinds = {g.kind for g in tc.compiled_graphs()}
    assert {"forward", "backward"} <= kinds, kinds
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(cpu.named_parameters(), tpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
