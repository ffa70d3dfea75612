"""ProcessGroupTPU in one process (a real size-1 gloo transport): input errors, Work semantics."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from torch_tpu.distributed import CollectiveError, GlooTransport, ProcessGroupTPU
from torch_tpu.distributed.worker import Deadline

TIMEOUT = datetime.timedelta(seconds=10)


class _GatedTransport(GlooTransport):
    """Real gloo transport whose all_reduce first waits for a gate and may fail (Work tests)."""

    def __init__(self) -> None:
        super().__init__(HashStore(), 0, 1, TIMEOUT)
        self.gate = threading.Event()
        self.fail = False
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        self.calls += 1
        self.gate.wait()
        if self.fail:
            raise RuntimeError("link down")
        super().all_reduce(tensor, op)


@pytest.fixture
def pg() -> ProcessGroupTPU:
    group = ProcessGroupTPU(GlooTransport(HashStore(), 0, 1, TIMEOUT), TIMEOUT)
    group.setGroupName("local")
    yield group
    group.shutdown()


def test_identity(pg: ProcessGroupTPU) -> None:
    assert (pg.getBackendName(), pg.getGroupName(), pg.group_name) == ("tpu_dist", "local", "local")
    assert (pg.rank(), pg.size()) == (0, 1)


def test_async_work_result_and_avg(pg: ProcessGroupTPU) -> None:
    t = torch.arange(4.0)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    work = pg.allreduce([t], opts)
    assert work.wait() is True
    assert work.is_completed() and work.is_success()
    torch.testing.assert_close(work.get_future().value()[0], torch.arange(4.0))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda pg: pg.all_to_all_single(torch.empty(2, 3), torch.empty(2, 3), [2], [3]),
         r"input_split_sizes \[3\] must be 1 non-negative row counts summing to the input's 2 rows"),
        (lambda pg: pg.all_to_all_single(torch.empty(2, 4), torch.empty(2, 3), [], []),
         r"rows of input and output must match"),
        (lambda pg: pg.all_gather_single(torch.empty(3), torch.empty(2)),
         r"all_gather_single: output has 3 elements, expected group size 1 x 2 = 2"),
        (lambda pg: pg.reduce_scatter_single(torch.empty(2, dtype=torch.int64), torch.empty(2)),
         r"input and output dtypes differ"),
        (lambda pg: pg.broadcast([torch.empty(1)], _root(dist.BroadcastOptions(), 1)),
         r"broadcast: root 1 is not a rank of this group \(size 1\)"),
        (lambda pg: pg.allgather([[torch.empty(2), torch.empty(2)]], [torch.empty(2)]),
         r"allgather: output list has 2 tensors; the group has 1 ranks"),
        (lambda pg: pg.allreduce_coalesced([torch.empty(1), torch.empty(1, dtype=torch.int32)]),
         r"must share dtype and device"),
        (lambda pg: pg.scatter([torch.empty(2)], [[torch.empty(3)]]),
         r"scatter: input for rank 0 is torch.float32\[3\], expected torch.float32\[2\]"),
    ],
)
def test_bad_input_raises_on_the_caller(pg: ProcessGroupTPU, call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(pg)


def _root(opts: object, root: int) -> object:
    opts.rootRank = root
    return opts


def test_wait_with_timeout_raises_instead_of_hanging() -> None:
    transport = _GatedTransport()
    pg = ProcessGroupTPU(transport, TIMEOUT)
    work = pg.allreduce([torch.ones(2)])
    with pytest.raises(CollectiveError, match=r"allreduce: Work.wait timed out after 0.2s"):
        work.wait(datetime.timedelta(seconds=0.2))
    transport.gate.set()
    assert work.wait() is True
    pg.shutdown()


def test_failure_poisons_the_group() -> None:
    transport = _GatedTransport()
    transport.fail = True
    transport.gate.set()
    pg = ProcessGroupTPU(transport, TIMEOUT)
    pg.setGroupName("g7")
    with pytest.raises(CollectiveError, match=r"tpu_dist allreduce failed on group 'g7' .*link down"):
        pg.allreduce([torch.ones(2)]).wait()
    with pytest.raises(CollectiveError, match="link down"):
        pg.allreduce([torch.ones(2)]).wait()
    assert transport.calls == 1  # the second collective never reached the transport
    pg.shutdown()


def test_transport_deadline_fails_a_stuck_job_and_poisons_the_group() -> None:
    """A transport with a deadline (the XLA transport's, whose calls can block forever): a job past
    it fails its Work with the deadline's message, later ones fail at once; jobs within it pass."""
    transport = _GatedTransport()
    transport.deadline = Deadline(datetime.timedelta(seconds=0.5), "gated collective")
    pg = ProcessGroupTPU(transport, TIMEOUT)
    transport.gate.set()
    quick = torch.ones(2)
    assert pg.allreduce([quick]).wait() is True
    assert quick.tolist() == [1.0, 1.0]
    transport.gate.clear()
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"allreduce failed .*gated collective did not finish within 0.5s"):
        pg.allreduce([torch.ones(2)]).wait()
    assert 0.5 <= time.monotonic() - start < 5
    with pytest.raises(CollectiveError, match="did not finish within"):
        pg.allreduce([torch.ones(2)]).wait()
    assert transport.calls == 2  # the third collective never reached the transport
    start = time.monotonic()
    pg.shutdown()  # does not wait for the stuck thread
    assert time.monotonic() - start < 5
    transport.gate.set()  # the stuck job returns late: its result is dropped
