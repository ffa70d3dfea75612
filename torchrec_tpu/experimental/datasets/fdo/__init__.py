"""FDO stats and clients (``torchrec.experimental.torch_tpu.datasets.fdo``)."""
