"""torchrec_tpu."""

__version__ = "0.1.0"
