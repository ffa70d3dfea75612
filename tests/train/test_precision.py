"""``--precision bf16``: the towers' forward under bf16 autocast (tpu device: its own policy and
the device's bf16 kernels; CPU torch's for towers on the host and TorchRec's engine), fp32
parameters and optimizer state; a job trains to the fp32 job's AUC."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.engines.dense_step import DLRMDenseLoss
from torchrec_tpu.train.engines.precision import autocast
from torchrec_tpu.train.job import run_job
from torchrec_tpu.train.model import ModelSpec, build_dlrm

SPEC = ModelSpec(feature_names=tuple(f"f{i}" for i in range(26)), table_sizes=(1,) * 26, embedding_dim=16,
                 dense_in_features=13, dense_layers=(64, 16), over_layers=(64, 32, 1))


def _batch(size: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(size, 13, generator=g), torch.randn(size, 26, 16, generator=g),
            torch.randint(0, 2, (size,), generator=g).float())


def test_bf16_towers_compute_in_bf16_with_fp32_parameters_and_loss() -> None:
    torch.manual_seed(0)
    towers = DLRMDenseLoss(build_dlrm(SPEC, dense_device=torch.device("cpu")), "bf16")
    dense, pooled, labels = _batch()
    seen = []
    towers.over_arch.register_forward_hook(lambda _m, args, out: seen.append((args[0].dtype, out.dtype)))
    loss = towers(dense, pooled, labels)
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # the interaction's output and the over arch in bf16
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in towers.parameters())
    fp32 = DLRMDenseLoss(build_dlrm(SPEC, dense_device=torch.device("cpu")))
    fp32.load_state_dict(towers.state_dict())
    with torch.no_grad():
        fp32_loss = float(fp32(dense, pooled, labels))
    assert fp32_loss == pytest.approx(float(loss.detach()), rel=2e-2)
    assert fp32_loss != float(loss.detach())


def test_compiled_tpu_step_in_bf16_matches_cpu_autocast() -> None:
    """The tpu towers' compiled bf16 step (train_step) against CPU torch's bf16 autocast, same
    init and batches, 3 SGD steps: the loss within 2e-3, and every weight as close to CPU's bf16
    weight as twice bf16's own distance from fp32 (the stated tolerance: bf16 rounding, not a
    different computation); fp32 as close as ever."""
    import torch_tpu.compile as tc

    trained = {}
    for precision in ("bf16", "fp32"):
        torch.manual_seed(0)
        cpu = DLRMDenseLoss(build_dlrm(SPEC, dense_device=torch.device("cpu")), precision)
        tpu = DLRMDenseLoss(build_dlrm(SPEC, dense_device=torch.device("cpu")), precision)
        tpu.load_state_dict(cpu.state_dict())
        tpu = tpu.to("tpu")
        cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.5)
        step = tc.train_step(tpu, torch.optim.SGD(tpu.parameters(), lr=0.5, foreach=True))
        for seed in range(3):
            batch = _batch(seed=seed)
            cpu_opt.zero_grad()
            cpu_loss = cpu(*batch)
            cpu_loss.backward()
            cpu_opt.step()
            tpu_loss = step(*(t.to("tpu") for t in batch))
        trained[precision] = (float(cpu_loss), float(tpu_loss), dict(cpu.named_parameters()),
                              {name: p.cpu() for name, p in tpu.named_parameters()})
    cpu_loss, tpu_loss, cpu_bf16, tpu_bf16 = trained["bf16"]
    fp32_cpu_loss, fp32_tpu_loss, cpu_fp32, tpu_fp32 = trained["fp32"]
    assert tpu_loss == pytest.approx(cpu_loss, abs=2e-3)
    assert tpu_loss != pytest.approx(fp32_tpu_loss, abs=1e-6)  # it did run in bf16
    for name, weight in cpu_bf16.items():
        bf16_noise = float((weight - cpu_fp32[name]).abs().max())
        assert float((tpu_bf16[name] - weight).abs().max()) <= 2 * bf16_noise + 1e-5, name
    assert fp32_tpu_loss == pytest.approx(fp32_cpu_loss, rel=1e-5)
    for name, weight in cpu_fp32.items():
        torch.testing.assert_close(tpu_fp32[name], weight.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_precision_is_an_option_of_both_engines() -> None:
    for engine in ("torchrec", "sparsecore"):
        assert TrainConfig.from_options(engine=engine, precision="bf16").optim.precision == "bf16"
    with pytest.raises(ConfigError, match=r"--precision='fp16' is not one of \['fp32', 'bf16'\]"):
        TrainConfig.from_options(precision="fp16")
    with pytest.raises(ValueError, match=r"precision 'fp8' is not one of \['fp32', 'bf16'\]"):
        autocast("cpu", "fp8")


@pytest.fixture(scope="module")
def default_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``train``'s default synthetic data (1M rows, the last file held out)."""
    out = tmp_path_factory.mktemp("default_synthetic")
    generate(SyntheticConfig(), out, progress=False)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine,dense_device", [("torchrec", None), ("sparsecore", "tpu")])
def test_bf16_job_reaches_the_fp32_auc(default_dataset: Path, tmp_path: Path, engine: str, dense_device) -> None:
    """The default model on the default data, one epoch, both precisions: AUC within 0.002."""
    extra = {"dense_device": dense_device} if dense_device else {}
    aucs = {}
    for precision in ("fp32", "bf16"):
        config = TrainConfig.from_options(data=str(default_dataset), log_dir=str(tmp_path / precision), engine=engine,
                                          precision=precision, progress=False, **extra)
        aucs[precision] = run_job(config).result.eval.auc
    assert aucs["fp32"] > 0.7
    assert abs(aucs["bf16"] - aucs["fp32"]) <= 0.002, aucs
