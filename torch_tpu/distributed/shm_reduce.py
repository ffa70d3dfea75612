"""Sum all_reduce of large host tensors through shared memory, for a group whose ranks all run on
one host (the loopback worlds of ``torchrun --nproc-per-node`` on a CPU host).

gloo sends them over TCP loopback: 64 MB (the dense gradients of MLPerf's DLRM-DCNv2) took 41 ms
between two ranks of a 2-core host, its kernel copies competing with the ranks' own work. Here each
rank copies its tensor into a shared segment of its own, sums its 1/W slice of every rank's segment
(in rank order, so every rank gets the same bits; with two ranks, gloo's), and copies the other
ranks' sums out: about 15 ms for 64 MB. A call waits at two barriers, datagrams over abstract UNIX
sockets (a waiting rank sleeps in ``recv``); calls alternate between two halves of the segments, so
a call's writes never meet a peer still reading the call before.
"""

from __future__ import annotations

import collections
import datetime
import mmap
import os
import socket
import struct
import sys
import uuid

import torch
from torch._C._distributed_c10d import PrefixStore, Store

MIN_BYTES = 1 << 20  # smaller tensors stay on gloo: its latency is no worse there
MAX_PIECE_BYTES = 64 << 20  # larger tensors go in pieces: at most 2 x 64 MiB of shared memory a rank
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
_MESSAGE = struct.Struct("<qB")  # barrier number, whether the sender's segment is usable


class SharedMemoryReduce:
    """The shared segments and barrier sockets of one group's ranks (see the module docstring)."""

    def __init__(self, token: str, rank: int, size: int, timeout: datetime.timedelta) -> None:
        self.rank, self.size, self._token = rank, size, token
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self._address(rank))
        self._socket.settimeout(timeout.total_seconds())
        self._barriers = 0
        self._arrivals: collections.Counter[int] = collections.Counter()
        self._refusals: set[int] = set()
        self._maps: list[mmap.mmap] = []
        self._capacity = 0  # bytes of each of a segment's two halves
        self._generation = 0
        self._calls = 0
        self.usable = True  # False once a rank could not get shared memory: gloo from then on

    @classmethod
    def connect(cls, store: Store, rank: int, size: int, timeout: datetime.timedelta) -> "SharedMemoryReduce | None":
        """Every rank of the group calls this; each gets one, or None on all unless every rank runs
        on this host (same host name and boot) of Linux with a ``/dev/shm``."""
        store = PrefixStore("shm_reduce", store)
        local = sys.platform.startswith("linux") and os.path.isdir("/dev/shm")
        store.set(f"host/{rank}", f"{socket.gethostname()}/{_boot_id()}" if local else f"not local/{rank}")
        hosts = {store.get(f"host/{r}").decode() for r in range(size)}
        if len(hosts) != 1 or not local:
            return None
        if rank == 0:
            store.set("token", uuid.uuid4().hex)
        reduce = cls(store.get("token").decode(), rank, size, timeout)
        store.set(f"bound/{rank}", "1")
        for r in range(size):
            store.get(f"bound/{r}")
        return reduce

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce_sum` runs ``tensor`` (the same answer on every rank of a call)."""
        return (self.usable and tensor.dtype in DTYPES and tensor.device.type == "cpu" and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() >= MIN_BYTES)

    def all_reduce_sum(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` over the ranks in place (in pieces of at most :data:`MAX_PIECE_BYTES`);
        False (nothing done, on every rank) when a rank could not map segments that large: the
        caller reduces it another way."""
        flat = tensor.view(-1)
        piece = max(1, MAX_PIECE_BYTES // tensor.element_size())
        nbytes = min(flat.numel(), piece) * tensor.element_size()
        if nbytes > self._capacity and not self._grow(min(max(nbytes, 2 * self._capacity), MAX_PIECE_BYTES)):
            return False
        for start in range(0, flat.numel(), piece):
            self._sum_piece(flat[start:start + piece])
        return True

    def _sum_piece(self, flat: torch.Tensor) -> None:
        offset = (self._calls % 2) * self._capacity
        self._calls += 1
        segments = [torch.frombuffer(m, dtype=flat.dtype, count=flat.numel(), offset=offset) for m in self._maps]
        segments[self.rank].copy_(flat)
        self._barrier()
        bounds = [flat.numel() * r // self.size for r in range(self.size + 1)]
        mine = slice(bounds[self.rank], bounds[self.rank + 1])
        torch.add(segments[0][mine], segments[1][mine], out=flat[mine])
        for segment in segments[2:]:
            flat[mine].add_(segment[mine])
        segments[self.rank][mine].copy_(flat[mine])
        self._barrier()
        for r, segment in enumerate(segments):
            if r != self.rank:
                flat[bounds[r]:bounds[r + 1]].copy_(segment[bounds[r]:bounds[r + 1]])

    def close(self) -> None:
        for m in self._maps:
            m.close()
        self._maps = []
        self._socket.close()

    def _grow(self, capacity: int) -> bool:
        """New segments of two halves of ``capacity`` bytes on every rank; False on every rank
        (and shared memory no longer used) when any rank could not get its own."""
        self._generation += 1
        path = self._path(self.rank)
        made, created = None, False
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            created = True
            try:
                os.posix_fallocate(fd, 0, 2 * capacity)  # no room: an error now, not SIGBUS on a write
                made = mmap.mmap(fd, 2 * capacity)
            finally:
                os.close(fd)
        except OSError:
            pass
        agreed = self._barrier(ok=made is not None)
        maps = []
        if agreed:
            for r in range(self.size):
                if r == self.rank:
                    maps.append(made)
                    continue
                fd = os.open(self._path(r), os.O_RDWR)
                try:
                    maps.append(mmap.mmap(fd, 2 * capacity))
                finally:
                    os.close(fd)
        self._barrier()  # every rank has mapped every segment: the names can go
        if created:
            os.unlink(path)
        if not agreed:
            if made is not None:
                made.close()
            self.usable = False
            return False
        for m in self._maps:
            m.close()
        self._maps, self._capacity = maps, capacity
        return True

    def _barrier(self, ok: bool = True) -> bool:
        """Wait until every rank reached this barrier; whether every rank said ``ok``."""
        self._barriers += 1
        number = self._barriers
        message = _MESSAGE.pack(number, ok)
        for r in range(self.size):
            if r != self.rank:
                self._socket.sendto(message, self._address(r))
        if not ok:
            self._refusals.add(number)
        while self._arrivals[number] < self.size - 1:
            try:
                data = self._socket.recv(_MESSAGE.size)
            except TimeoutError:
                raise RuntimeError(f"shared-memory all_reduce: rank {self.rank} waited at barrier {number} past "
                                   f"the timeout ({self._socket.gettimeout():g} s); a peer rank stalled or exited"
                                   ) from None
            arrived, peer_ok = _MESSAGE.unpack(data)
            self._arrivals[arrived] += 1
            if not peer_ok:
                self._refusals.add(arrived)
        del self._arrivals[number]
        refused = number in self._refusals
        self._refusals.discard(number)
        return not refused

    def _address(self, rank: int) -> bytes:
        return f"\0tpu_dist_shm/{self._token}/{rank}".encode()

    def _path(self, rank: int) -> str:
        return f"/dev/shm/tpu_dist_{self._token}_{rank}_{self._generation}"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown boot"
