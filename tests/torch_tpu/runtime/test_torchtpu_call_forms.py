"""The call forms code written for TorchTPU 0.2.0 uses (issue 58's probes), each against what it
must do: compile options, meshes, RNG state by keyword, streams and events with TorchTPU's
arguments, ``jax_op`` as a decorator, ``synchronize(tensor, wait=True)``, eager modes, the
properties, compiler options and the installed-distribution answer."""

from __future__ import annotations

import importlib.metadata

import jax
import pytest
import torch

import torch_tpu  # noqa: F401


@pytest.mark.parametrize("options", [{"num_dynamic_buckets": 2}, {"bucket_size": 64}, {"async_compile": True},
                                     {"serializable": False}])
def test_compile_takes_torchtpus_options(options: dict) -> None:
    f = torch.compile(lambda x: x * 2 + 1, backend="tpu", options=options)
    x = torch.arange(4.0)
    torch.testing.assert_close(f(x.to("tpu")).cpu(), x * 2 + 1)


def test_compile_refuses_an_unknown_option() -> None:
    f = torch.compile(lambda x: x + 1, backend="tpu", options={"num_dynamic_bucket": 2})
    with pytest.raises(Exception, match="unknown option 'num_dynamic_bucket'"):
        f(torch.ones(2, device="tpu"))


@pytest.mark.parametrize("options", ["a string", ["async_compile"], 3], ids=["str", "list", "int"])
def test_compile_refuses_options_that_are_not_a_dict(options) -> None:
    # a string gave AttributeError: 'str' object has no attribute 'items'
    f = torch.compile(lambda x: x + 1, backend="tpu", options=options)
    with pytest.raises(Exception, match=f"options must be a dict of option names to values .*, got "
                                        f"{type(options).__name__} ") as info:
        f(torch.ones(2, device="tpu"))
    assert isinstance(getattr(info.value, "inner_exception", info.value), TypeError)  # (Dynamo wraps it)


def test_topology_aware_mesh_of_one_process() -> None:
    for mesh in (torch.tpu.topology_aware_mesh((1,)), torch.tpu.distributed.topology_aware_mesh((1, 1))):
        assert mesh.dtype == torch.int64 and mesh.flatten().tolist() == [0]
    with pytest.raises(RuntimeError, match="spans 2 devices"):
        torch.tpu.distributed.topology_aware_mesh((2,))


def test_rng_state_by_keyword_replays_the_draws() -> None:
    torch.tpu.manual_seed(3)
    state = torch.tpu.get_rng_state(device="tpu")
    first = torch.rand(4, device="tpu").cpu()
    torch.tpu.set_rng_state(new_state=state, device="tpu")
    torch.testing.assert_close(torch.rand(4, device="tpu").cpu(), first, rtol=0, atol=0)
    gen = torch.tpu.default_generators[0]
    gen.manual_seed(3)
    torch.testing.assert_close(torch.rand(4, device="tpu").cpu(), first, rtol=0, atol=0)
    assert gen.initial_seed() == 3 and torch.tpu.default_generators is torch.tpu.default_generators


def test_stream_and_event_take_torchtpus_arguments() -> None:
    stream = torch.tpu.Stream(device="tpu", priority=0, stream_id=0)
    event = torch.tpu.Event(enable_timing=True, external=False, device="tpu")
    y = torch.ones(8, device="tpu") * 3
    event.record(stream)
    event.synchronize()
    assert event.query() and stream.query() and y.sum().item() == 24


def test_jax_op_as_a_decorator_and_a_call() -> None:
    @torch.tpu.pallas.jax_op("probe58::scale")
    def scale(x: jax.Array, factor: float) -> jax.Array:
        return x * factor

    def add(x: jax.Array, y: jax.Array) -> jax.Array:
        return x + y

    plus = torch.tpu.pallas.jax_op("probe58::plus", add)
    x = torch.arange(3.0, device="tpu")
    torch.testing.assert_close(scale(x, 2.0).cpu(), torch.tensor([0.0, 2.0, 4.0]))
    torch.testing.assert_close(plus(x, x).cpu(), torch.tensor([0.0, 2.0, 4.0]))
    with pytest.raises(ValueError, match="exactly one '::'"):
        torch.tpu.pallas.jax_op("no_namespace", lambda x: x)
    mesh = torch.tpu.pallas.get_pallas_mesh("x")
    assert mesh.axis_names == ("x",) and mesh.devices.size == 1


def test_synchronize_a_tensor_and_wait() -> None:
    from torch_tpu._internal import sync

    x = torch.ones(4, device="tpu") + 1
    sync.synchronize(x, wait=True)
    sync.synchronize([x, x * 2], wait=False)
    sync.synchronize()
    assert sync.is_materialized(x) and not sync.is_materializing(x)
    assert "func.func" in sync.computation_mlir(x)
    torch.tpu.synchronize()


def test_eager_mode_property_and_context_manager() -> None:
    before = torch.tpu.eager_mode
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEBUG
        torch.testing.assert_close((torch.ones(2, device="tpu") * 2).cpu(), torch.full((2,), 2.0))
    assert torch.tpu.eager_mode is before
    torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_NEVER
    assert torch.tpu.eager_mode is torch.tpu.EagerMode.STRICT
    torch.tpu.eager_mode = before


def test_compiler_options_reach_the_compiled_program() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    f = torch.compile(lambda t: t.exp().sum(), backend="tpu")
    with torch.tpu.compiler.custom_compiler_options({"xla_cpu_enable_fast_math": "false"}):
        torch.testing.assert_close(f(x.to("tpu")).cpu(), x.exp().sum())
    with pytest.raises(ValueError, match="xla_optimization_level must be one of"):
        with torch.tpu.compiler.custom_compiler_options({"xla_optimization_level": "O9"}):
            pass
    assert torch.tpu.allow_excess_precision is False
    torch.tpu.allow_excess_precision = True
    try:
        assert torch.tpu.allow_excess_precision is True
        torch.testing.assert_close(f(x.to("tpu")).cpu(), x.exp().sum())
    finally:
        torch.tpu.allow_excess_precision = False


def test_distributed_window_settings_are_checked_properties() -> None:
    d = torch.tpu.distributed
    d.window_num_stripes = 4
    assert d.window_num_stripes == 4
    with pytest.raises(ValueError, match="window_stripe_chunk_mb must be a positive int, got 0"):
        d.window_stripe_chunk_mb = 0
    d.window_num_stripes = 1


def test_set_tpu_launch_env_fills_only_unset_variables(monkeypatch) -> None:
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "TPU_WORKER_HOSTNAMES", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "1234")
    torch.tpu.distributed.set_tpu_launch_env()
    import os

    assert (os.environ["NNODES"], os.environ["NODE_RANK"], os.environ["MASTER_PORT"]) == ("1", "0", "1234")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "a,b")
    with pytest.raises(ValueError, match="expected nnodes to match"):
        torch.tpu.distributed.set_tpu_launch_env(nnodes=3)


def test_spmd_safe_keeps_the_function() -> None:
    @torch.tpu.distributed.spmd_safe
    def double(x: torch.Tensor) -> torch.Tensor:
        """Doubles."""
        return x * 2

    assert double.__doc__ == "Doubles." and double(torch.ones(2)).tolist() == [2.0, 2.0]


def test_the_project_answers_as_the_torch_tpu_distribution() -> None:
    dist = importlib.metadata.distribution("torch-tpu")
    assert dist.metadata["Name"] == "torch-tpu" and dist.version.startswith("0.2.0")
    assert importlib.metadata.version("torch_tpu") == dist.version
    assert importlib.metadata.distribution("torchrec-tpu").metadata["Name"] == "torchrec-tpu"  # its own, unchanged


def test_a_tpu_only_compiler_option_is_ignored_off_a_tpu_with_one_warning() -> None:
    """TorchTPU's own docstring example: XLA:CPU refuses the option, so it is left out (one warning)."""
    x = torch.arange(6.0).reshape(2, 3)
    with pytest.warns(RuntimeWarning, match="xla_tpu_enable_deduplicated_calls apply on TPU only") as caught:
        with torch.tpu.compiler.custom_compiler_options({"xla_tpu_enable_deduplicated_calls": "true"}):
            for scale in (2.0, 3.0):
                f = torch.compile(lambda t, s=scale: (t * s).sum(), backend="tpu")
                torch.testing.assert_close(f(x.to("tpu")).cpu(), (x * scale).sum())
    assert len([w for w in caught if "apply on TPU only" in str(w.message)]) == 1


def test_eager_modes_carry_torchtpus_names_and_order() -> None:
    """TorchTPU's member names and order (its snapshot: tests/torch_tpu/data/torchtpu_0_2_0_api.json);
    the project's STRICT / DEBUG are aliases, and the values stay TORCH_TPU_EAGER_MODE's."""
    mode = torch.tpu.EagerMode
    assert [m.name for m in mode] == ["DEFER_AND_FUSE", "DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING"]
    assert mode.DEFER_NEVER.name == "DEFER_NEVER" and mode.STRICT is mode.DEFER_NEVER
    assert mode.DEBUG is mode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    assert mode("strict") is mode.DEFER_NEVER and mode("debug").name == "DEFER_NEVER_AND_LAUNCH_BLOCKING"


def test_topology_aware_mesh_off_a_tpu_is_the_ranks_in_order(tmp_path, monkeypatch) -> None:
    """Under plain torchrun (a process group, no TPU_TOPOLOGY / TPU_ACCELERATOR_TYPE) the mesh is the
    world's ranks in order, said once; before, it asked for TPU_TOPOLOGY."""
    import torch.distributed as dist

    from torch_tpu._internal import tpu_distributed

    for name in ("TPU_TOPOLOGY", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(name, raising=False)
    tpu_distributed._say_once.cache_clear()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.warns(RuntimeWarning, match="the mesh is the 1 ranks in order") as caught:
            for shape in ((1,), (1, 1)):
                mesh = torch.tpu.topology_aware_mesh(shape)
                assert mesh.dtype == torch.int64 and mesh.shape == shape and mesh.flatten().tolist() == [0]
        assert len(caught) == 1
        with pytest.raises(ValueError, match=r"mesh_shape \(2,\) holds 2 devices, the process group 1"):
            torch.tpu.topology_aware_mesh((2,))
    finally:
        dist.destroy_process_group()
