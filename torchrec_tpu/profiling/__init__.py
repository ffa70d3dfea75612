"""Profiling of training steps: torch.profiler (host ops, our phase ranges) + jax.profiler (device)."""
