"""tpu tensors over a process group of another backend (plain ``gloo``): every c10d collective
raises one error naming ``tpu_dist`` instead of leaving each rank its own values (the CPU fallback
used to run the collective on host copies it then dropped); cpu tensors on the same group still
reduce. Two real processes on loopback."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from torch_tpu.distributed.local_launch import launch_local

BATCH = 8


def _collectives(rank: int) -> dict[str, object]:
    """Per collective: the tpu tensor's values after it, or the error it raised."""
    t = torch.full((3,), float(rank + 1), device="tpu")
    calls = {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_reduce async": lambda: dist.all_reduce(t, async_op=True).wait(),
        "broadcast": lambda: dist.broadcast(t, 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(6, device="tpu"), t),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t[:1].clone(), torch.ones(2, device="tpu")),
        "send/recv": lambda: dist.send(t, 1) if rank == 0 else dist.recv(t, 0),
    }
    out: dict[str, object] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = t.cpu().tolist()
        except RuntimeError as e:
            out[name] = f"RuntimeError: {e}"
    return out


def _fused_ebc(world: int) -> str:
    """What a 2-rank fused EBC's forward (TorchRec's TPU module) gives on the gloo group: the error,
    or "no error"."""
    from torchrec.experimental.torch_tpu import (
        SparseCoreEmbeddingConfig,
        SparseCoreFusedEmbeddingBagCollection,
        SparseCoreInputPreprocessor,
    )
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [SparseCoreEmbeddingConfig(config=EmbeddingBagConfig(name="t", num_embeddings=64, embedding_dim=8,
                                                                  feature_names=["f"]))]
    try:
        fused = SparseCoreFusedEmbeddingBagCollection(tables=tables, optimizer_type=torch.optim.SGD,
                                                      optimizer_kwargs={"lr": 0.1}, batch_size=BATCH,
                                                      global_device_count=world)
        kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(BATCH), lengths=torch.ones(BATCH, dtype=torch.long))
        preprocessor = SparseCoreInputPreprocessor(tables, batch_size=BATCH, global_device_count=world)
        fused(preprocessor(kjt).to("tpu")).values().cpu()
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return "no error"


def _rank(rank: int, world: int, store: dist.Store, timeout: datetime.timedelta) -> dict[str, object]:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    import torch_tpu  # noqa: F401

    out = _collectives(rank)
    host = torch.full((3,), float(rank + 1))
    dist.all_reduce(host)
    out["cpu all_reduce"] = host.tolist()
    out["fused EBC"] = _fused_ebc(world)
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_collectives_on_tpu_tensors_over_gloo_raise_naming_tpu_dist() -> None:
    for rank, out in enumerate(launch_local(_rank, 2, timeout_s=60)):
        assert out.pop("cpu all_reduce") == [3.0, 3.0, 3.0]
        for name, result in out.items():
            assert isinstance(result, str), f"rank {rank}: {name} returned {result} on a gloo group"
            assert "has no backend for tpu tensors" in result and "tpu_dist" in result, (rank, name, result)
            assert "gloo" in result.split(";")[0], result
