"""Reads and writes through arbitrary strided views (compiled per layout) equal CPU torch's."""

from __future__ import annotations

import torch

import torch_tpu  # noqa: F401  (registers the "tpu" device)

STORAGE = 96


# (shape, stride, offset) over a storage of 96 elements
LAYOUTS = [
    ((12, 8), (1, 12), 0),  # transpose
    ((3, 4, 2), (1, 6, 3), 0),  # permute of a contiguous (4, 2, 3)
    ((4, 3), (24, 4), 2),  # slice with steps in both dims
    ((8, 2), (12, 1), 10),  # last columns: the spanned region runs past the storage end
    ((8,), (13,), 0),  # diagonal
    ((4,), (1,), 50),  # narrow / select: a contiguous run
    ((), (), 7),  # one element
    ((3, 4), (0, 1), 5),  # expand (read only: its elements repeat)
    ((5, 4), (3, 1), 0),  # unfold: overlapping windows (read only)
    ((2, 2), (3, 8), 1),  # no stride divides the other: gathered and scattered by index
]


def test_strided_views_read_and_write_like_cpu():
    gen = torch.Generator().manual_seed(0)
    cpu = torch.randn(STORAGE, generator=gen)
    tpu = cpu.to("tpu")
    for shape, stride, offset in LAYOUTS:
        where = f"shape {shape} stride {stride} offset {offset}"
        torch.testing.assert_close(tpu.as_strided(shape, stride, offset).cpu(),
                                   cpu.as_strided(shape, stride, offset), rtol=0, atol=0, msg=where)
        distinct = all(n == 1 or s != 0 for n, s in zip(shape, stride))
        sorted_dims = sorted((s, n) for n, s in zip(shape, stride) if n > 1)
        overlapping = any(s1 * n1 > s2 for (s1, n1), (s2, _) in zip(sorted_dims, sorted_dims[1:]))
        if distinct and not overlapping:  # torch's copy_ into self-overlapping views is undefined
            value = torch.randn(shape, generator=gen)
            cpu.as_strided(shape, stride, offset).copy_(value)
            tpu.as_strided(shape, stride, offset).copy_(value.to("tpu"))
            torch.testing.assert_close(tpu.cpu(), cpu, rtol=0, atol=0, msg=where)
