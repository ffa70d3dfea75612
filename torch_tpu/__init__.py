"""torch_tpu."""
