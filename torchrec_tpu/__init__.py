"""torchrec_tpu."""
