"""HSTU (generative recommenders) attention on the tpu device: pointwise SiLU attention over jagged
sequences, causal, with relative position and time-gap biases (``tiles``: the equations;
``padded``: XLA and Pallas paths with a custom VJP; ``jagged``: the torch operator)."""

from torch_tpu.ops.hstu.jagged import jagged_hstu_attention, tile_size
from torch_tpu.ops.hstu.padded import KERNELS
from torch_tpu.ops.hstu.tiles import time_buckets

__all__ = ["KERNELS", "jagged_hstu_attention", "tile_size", "time_buckets"]
