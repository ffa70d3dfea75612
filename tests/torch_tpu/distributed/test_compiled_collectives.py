"""Collectives inside ``torch.compile(backend="tpu")`` graphs, on 2 loopback ranks (XLA transport).

One spawned job runs every check: ``dist.all_reduce`` and the functional collectives
(``all_reduce``, ``all_gather_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``,
``broadcast``) in a
compiled function equal eager; a backward through ``all_gather_tensor_autograd`` (a
reduce-scatter in the compiled backward graph) equals eager's gradients; and ranks that compiled
different collectives both fail with :class:`CollectiveMismatchError` naming both sequences,
well within the group timeout, instead of deadlocking. Under ``fuse_collectives()`` the same
functions (and the backward) compile to ONE program each with the collectives inside, equal to
eager; a graph the mode cannot express (a PRODUCT all_reduce) falls back to the split graph.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from tests.torch_tpu.distributed.device import launch_on_tpu, mismatch_outcome

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TIMEOUT_S = 60.0


def _cpu(tree: object) -> object:
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), tree)


def _job(rank: int, size: int, store: dist.Store, timeout: datetime.timedelta) -> dict:
    import torch_tpu.distributed as tpu_dist

    os.environ[tpu_dist.backend.TRANSPORT_ENV] = "xla"
    dist.init_process_group("tpu_dist", store=store, rank=rank, world_size=size, timeout=timeout)
    import torch._dynamo
    import torch.distributed._functional_collectives as fc

    import torch_tpu.compile as tpu_compile
    from torch_tpu.compile.collectives.fused_collectives import FusedGraph

    world = dist.group.WORLD
    results: dict = {"transport": tpu_dist.active_transport()}

    def inplace(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    def functional(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = fc.all_reduce(x * 2, "sum", world)
        g = fc.all_gather_tensor(y.sin(), 0, world)
        r = fc.reduce_scatter_tensor(g * 3, "sum", 0, world)
        a = fc.all_to_all_single(r.reshape(-1) + 1, None, None, world)
        return fc.broadcast(a.cos(), 1, world), g

    def loss_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = fc.all_gather_tensor_autograd(x * w, 0, world)
        return (y * y).sum()

    x = torch.arange(8.0, device="tpu").reshape(4, 2) + 10 * rank
    for name, fn in [("inplace", inplace), ("functional", functional)]:
        torch._dynamo.reset()
        tpu_compile.reset_compile_stats()
        got = torch.compile(fn, backend="tpu")(x)
        again = torch.compile(fn, backend="tpu")(x + 1)  # the compiled graph, called again
        results[name] = {
            "got": _cpu(got), "ref": _cpu(fn(x)), "again": _cpu(again), "again_ref": _cpu(fn(x + 1)),
            "segments": len(tpu_compile.compiled_graphs()),
            "on_tpu": [t.device.type for t in (got if isinstance(got, tuple) else (got,))],
        }

    def product(x: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(x + 1, "product", world) * 2

    for name, fn in [("inplace", inplace), ("functional", functional), ("product", product)]:
        torch._dynamo.reset()
        tpu_compile.reset_compile_stats()
        with tpu_compile.fuse_collectives():
            got = torch.compile(fn, backend="tpu")(x)
        again = torch.compile(fn, backend="tpu")(x + 1)  # outside the context: the fused graph stays
        programs = tpu_compile.compiled_graphs()
        results[f"fused_{name}"] = {
            "got": _cpu(got), "ref": _cpu(fn(x)), "again": _cpu(again), "again_ref": _cpu(fn(x + 1)),
            "fused": [isinstance(p, FusedGraph) for p in programs],
            "hlo_collectives": sum(p.stablehlo().count("stablehlo.all_") for p in programs),
        }

    torch._dynamo.reset()
    tpu_compile.reset_compile_stats()
    w = torch.tensor([1.0, -2.0], device="tpu", requires_grad=True)
    with tpu_compile.fuse_collectives():  # the backward graph compiles at the first backward
        loss = torch.compile(loss_fn, backend="tpu")(x, w)
        loss.backward()
    results["fused_backward"] = {"loss": _cpu(loss), "grad": _cpu(w.grad),
                                 "fused": [isinstance(p, FusedGraph) for p in tpu_compile.compiled_graphs()]}

    torch._dynamo.reset()
    w = torch.tensor([1.0, -2.0], device="tpu", requires_grad=True)
    loss = torch.compile(loss_fn, backend="tpu")(x, w)
    loss.backward()
    w_ref = torch.tensor([1.0, -2.0], device="tpu", requires_grad=True)
    loss_ref = loss_fn(x, w_ref)
    loss_ref.backward()
    results["backward"] = {"loss": _cpu(loss), "loss_ref": _cpu(loss_ref),
                           "grad": _cpu(w.grad), "grad_ref": _cpu(w_ref.grad)}

    # rank 0 compiles an all_reduce, rank 1 an all_gather: both must fail, naming both sequences
    def differs(x: torch.Tensor) -> torch.Tensor:
        if rank == 0:
            return fc.all_reduce(x + 1, "sum", world)
        return fc.all_gather_tensor(x + 1, 0, world)

    torch._dynamo.reset()
    results["mismatch"], results["mismatch_s"] = mismatch_outcome(lambda: torch.compile(differs, backend="tpu")(x))
    dist.barrier()  # the group is still usable after the check failed
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch_on_tpu(_job, 2, TIMEOUT_S)


def _same(got: object, ref: object) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_runs_on_the_xla_transport(ranks: list[dict]) -> None:
    assert [r["transport"] for r in ranks] == ["xla", "xla"]


def test_dist_all_reduce_in_a_compiled_function_equals_eager(ranks: list[dict]) -> None:
    for r in ranks:
        got = r["inplace"]
        _same(got["got"], got["ref"])
        _same(got["again"], got["again_ref"])
        assert got["on_tpu"] == ["tpu"]
        assert got["segments"] == 2  # x * 2 | all_reduce | + 1
    # both ranks hold the sum: (x0 + x1) * 2 + 1
    _same(ranks[0]["inplace"]["got"], ranks[1]["inplace"]["got"])


def test_functional_collectives_in_a_compiled_function_equal_eager(ranks: list[dict]) -> None:
    for r in ranks:
        got = r["functional"]
        _same(got["got"], got["ref"])
        _same(got["again"], got["again_ref"])
        assert got["on_tpu"] == ["tpu", "tpu"]
        assert got["segments"] == 5  # compute between the five collectives
    _same(ranks[0]["functional"]["got"][0], ranks[1]["functional"]["got"][0])  # rank 1's, broadcast


def test_backward_through_a_compiled_collective_equals_eager(ranks: list[dict]) -> None:
    for r in ranks:
        b = r["backward"]
        _same(b["loss"], b["loss_ref"])
        _same(b["grad"], b["grad_ref"])


def test_ranks_with_different_collectives_both_fail_clearly(ranks: list[dict]) -> None:
    for rank, r in enumerate(ranks):
        msg = r["mismatch"]
        assert "differ between ranks" in msg, f"rank {rank}: {msg}"
        assert "_c10d_functional::all_reduce" in msg and "_c10d_functional::all_gather_into_tensor" in msg
        assert msg.count("digest") >= 2
        assert r["mismatch_s"] < TIMEOUT_S


def test_fused_collectives_are_one_program_equal_to_eager(ranks: list[dict]) -> None:
    for r in ranks:
        for name in ("inplace", "functional"):
            got = r[f"fused_{name}"]
            _same(got["got"], got["ref"])
            _same(got["again"], got["again_ref"])
            assert got["fused"] == [True], name  # one program, no segments
            assert got["hlo_collectives"] >= 1, name  # the collectives are in the program


def test_fused_backward_equals_eager(ranks: list[dict]) -> None:
    for r in ranks:
        f, ref = r["fused_backward"], r["backward"]
        assert f["fused"] == [True, True]  # forward (all_gather) and backward (reduce_scatter)
        _same(f["loss"], ref["loss_ref"])
        _same(f["grad"], ref["grad_ref"])


def test_unfusable_graph_falls_back_to_the_split_graph(ranks: list[dict]) -> None:
    for r in ranks:
        got = r["fused_product"]
        _same(got["got"], got["ref"])
        assert got["fused"] == [False, False]  # x + 1 | all_reduce(product) | * 2
