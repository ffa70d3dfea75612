"""Every one of the 19 exports of TorchRec 1.9.2's ``torchrec.experimental.torch_tpu`` imports with
``torch_tpu`` installed, and each is exercised against an independent reference by a test named
here (``TPUEmbeddingUnfused`` below: its gather and gradient against ``F.embedding``)."""

from __future__ import annotations

# isort: off
import torch_tpu  # noqa: F401  (TorchTPU's environment before TorchRec's TPU module)
# isort: on
import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchrec.experimental.torch_tpu as trt

HERE = Path(__file__).parent
# export -> (test file, test function) exercising it
EXERCISED = {
    "SparseCoreEmbeddingConfig": ("test_fused_modules.py",
                                  "test_one_fused_sgd_step_equals_torchrec_and_runs_on_the_device"),
    "StackedSparseCoreEmbeddingConfig": ("test_fused_modules.py", "test_stacking_functions_lay_tables_out_mod_sharded"),
    "SparseCoreFusedEmbeddingBagCollection": ("test_fused_modules.py",
                                              "test_three_fused_steps_equal_stock_torchrec_with_torchrec_tpus_optimizer"),
    "SparseCoreFusedEmbeddingCollection": ("test_fused_modules.py",
                                           "test_three_fused_steps_equal_stock_torchrec_with_torchrec_tpus_optimizer"),
    "TPUEmbeddingUnfused": ("test_exports.py", "test_tpu_embedding_unfused_gathers_and_differentiates_like_embedding"),
    "SparseCoreInputPreprocessor": ("test_torch_tpu_api.py", "test_torchrec_preprocessing_is_jax_tpu_embeddings_bytes"),
    "KeyedSparseCorePreprocessedInput": ("test_fused_modules.py",
                                         "test_one_fused_sgd_step_equals_torchrec_and_runs_on_the_device"),
    "SparseCorePreprocessedInput": ("test_fused_modules.py",
                                    "test_one_fused_sgd_step_equals_torchrec_and_runs_on_the_device"),
    "PrefetchDataLoader": ("test_pipeline_and_checkpoint.py",
                           "test_pipeline_on_two_tpu_dist_ranks_equals_its_schedule_on_cpu_and_checkpoints"),
    "SparseCoreBatch": ("test_pipeline_and_checkpoint.py",
                        "test_sparsecore_data_loader_and_batch_preprocess_each_batch"),
    "SparseCoreDataLoader": ("test_pipeline_and_checkpoint.py",
                             "test_sparsecore_data_loader_and_batch_preprocess_each_batch"),
    "SparseCoreSavePlanner": ("test_pipeline_and_checkpoint.py",
                              "test_pipeline_on_two_tpu_dist_ranks_equals_its_schedule_on_cpu_and_checkpoints"),
    "SparseCoreLoadPlanner": ("test_pipeline_and_checkpoint.py",
                              "test_pipeline_on_two_tpu_dist_ranks_equals_its_schedule_on_cpu_and_checkpoints"),
    "SparseCoreTrainPipeline": ("test_pipeline_and_checkpoint.py",
                                "test_pipeline_with_prefetch_loader_on_one_rank_equals_its_schedule_on_cpu_and_checkpoints"),
    "stack_tables": ("test_fused_modules.py", "test_stacking_functions_lay_tables_out_mod_sharded"),
    "auto_stack_tables": ("test_fused_modules.py", "test_stacking_functions_lay_tables_out_mod_sharded"),
    "prepare_tables_for_stacking": ("test_fused_modules.py", "test_stacking_functions_lay_tables_out_mod_sharded"),
    "stack_and_shard_tables": ("test_fused_modules.py", "test_stacking_functions_lay_tables_out_mod_sharded"),
    "unshard_and_unstack_tables": ("test_fused_modules.py", "test_stacking_functions_lay_tables_out_mod_sharded"),
}


def test_all_19_exports_import_and_each_is_exercised_by_a_named_test() -> None:
    assert sorted(trt.__all__) == sorted(EXERCISED) and len(EXERCISED) == 19
    for name in trt.__all__:
        assert getattr(importlib.import_module("torchrec.experimental.torch_tpu"), name) is not None, name
    for name, (file, test) in EXERCISED.items():
        source = (HERE / file).read_text()
        assert f"def {test}(" in source, (name, file, test)
        assert name in source, f"{file} does not use {name}"


@pytest.mark.parametrize("kernels", ["ops", "pallas"])
def test_tpu_embedding_unfused_gathers_and_differentiates_like_embedding(kernels: str, monkeypatch) -> None:
    """Without TorchRec's Pallas registrations the op runs its CPU kernel (counted); with them
    (``pallas/impl.py`` through ``torch_tpu._internal.pallas``), the TensorCore gather runs on the
    device in Pallas interpret mode and its backward as a device scatter-add."""
    if kernels == "pallas":
        from torchrec.experimental.torch_tpu.pallas import impl  # noqa: F401

        monkeypatch.setenv("LOOKUP_MODE", "v1_tpu")
    module = trt.TPUEmbeddingUnfused(num_embeddings=40, embedding_dim=16, device=torch.device("tpu"),
                                     dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(40, 16, generator=g)
    with torch.no_grad():
        module.weight.copy_(table.to("tpu"))
    ids = torch.tensor([3, 1, 3, 39, 0], dtype=torch.int32)
    out = module(ids.to("tpu"))
    reference = table.clone().requires_grad_(True)
    expected = F.embedding(ids.long(), reference)
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=0, atol=0)
    seed = torch.randn(expected.shape, generator=g)
    out.backward(seed.to("tpu"))
    expected.backward(seed)
    torch.testing.assert_close(module.weight.grad.cpu(), reference.grad, rtol=1e-6, atol=1e-6)
    assert module.split_embedding_weights()[0] is module.weight


def test_retired_copy_re_exports_torchrecs_names() -> None:
    import torchrec_tpu.experimental as retired

    assert sorted(retired.__all__) == sorted(trt.__all__)
    for name in trt.__all__:
        assert getattr(retired, name) is getattr(trt, name), name
    with pytest.raises(AttributeError, match=r"has no attribute 'SparseCoreFusedEBC'; it re-exports"):
        _ = retired.SparseCoreFusedEBC
